#!/usr/bin/env bash
# The `qfd all` pipeline as single stages, the way a user scripts it on a GPU box. Every stage
# reads and writes checkpoint directories; re-running a finished stage is refused unless
# --overwrite, and an interrupted one resumes from <out>.partial/.
#
#   bash examples/pipeline_by_hand.sh [MODEL] [RUN_DIR]
#
# MODEL defaults to the embedded SmolLM2-135M (CPU-sized settings); pass a BF16 model directory
# or hub id and raise the step counts for a real target.
set -euo pipefail
MODEL=${1:-smollm2-135m}
RUN=${2:-runs/by-hand}
mkdir -p "$RUN"

qfd quantize --model "$MODEL" --method gptq --samples 32 --out "$RUN/int4"
qfd qad --ckpt "$RUN/int4" --teacher "$MODEL" --generate-samples 64 --steps 60 --seq-len 256 --out "$RUN/qad"
qfd draft data --target "$MODEL" --num 160 --max-new-tokens 128 --out "$RUN/data-bf16"
qfd draft train --stage 1 --target "$MODEL" --data "$RUN/data-bf16" --max-minutes 3 --out "$RUN/drafter1"
qfd draft data --target "$RUN/qad" --num 160 --max-new-tokens 128 --out "$RUN/data-int4"
qfd draft train --stage 2 --target "$RUN/qad" --init "$RUN/drafter1" --data "$RUN/data-int4" --max-minutes 1.5 --out "$RUN/drafter2"
qfd draft quantize --drafter "$RUN/drafter2" --target "$RUN/qad" --data "$RUN/data-int4" --samples 32 --out "$RUN/drafter-int4"
qfd draft swa --drafter "$RUN/drafter-int4" --window 1024 --out "$RUN/drafter-final"
qfd eval latency --target "$RUN/qad" --drafter "$RUN/drafter-final" --baseline "$MODEL" --scale 0.05 --warmup 1 --runs 3 --out "$RUN/latency"
qfd info "$RUN/drafter-final"
