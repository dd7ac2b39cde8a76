#!/usr/bin/env bash
# The CPU figures of the closing notes, side by side in one run each (2-core dev box; ratios
# only, absolute times mean nothing here). RUN = a finished `qfd all` directory (demo preset).
#   bash bench/cpu_all.sh runs/demo
set -euo pipefail
RUN=${1:-runs/demo}
mkdir -p bench/results
python bench/bench_generate.py --target smollm2-135m --max-new-tokens 64 --repeats 3 --out bench/results/cpu_generate.json
python bench/bench_drafter_swa.py --shape embedded --contexts 1024,8192 --window 1024 --repeats 10 --warmup 2 --out bench/results/cpu_drafter_swa.json
python bench/bench_latency.py --target smollm2-135m --int4 "$RUN/2-qad" --drafter "$RUN/8-draft-swa" --settings short,medium --scale 0.25 --warmup 1 --runs 3 --out bench/results/cpu_latency.json
