#!/usr/bin/env bash
# One device call (H200): the Qwen3.5-4B-shape step costs and projected speedup
# (bench_steps.py), then the QAD memory plan (bench_qad_memory.py). Random weights: exact
# step costs and memory, no quality. Each part is time-boxed; both write JSON under $OUT.
#   SETTINGS   latency settings to time (default short,medium,long)
#   COMPILE=1  time the steps again with --compile (torch.compile before CUDA-graph capture),
#              side by side in the same call (steps_compiled.json)
#   QAD_S=0    skip the QAD memory plan
export PYTHONPATH=${QFD_SRC:-$PWD} PYTHONUNBUFFERED=1
SRC=${QFD_SRC:-$PWD}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
steps() {  # steps NAME [FLAGS...]
    name=$1; shift
    timeout "${STEPS_S:-140}" python3 "$SRC/bench/bench_steps.py" --device cuda --settings "${SETTINGS:-short,medium,long}" "$@" \
        --out "$OUT/$name.json" 2>&1 | grep -v Warning | tee "$OUT/$name.log" | tail -40
}
steps steps
[ -z "${COMPILE:-}" ] || steps steps_compiled --compile
[ "${QAD_S:-75}" = 0 ] || timeout "${QAD_S:-75}" python3 "$SRC/bench/bench_qad_memory.py" --steps 2 --seq-len 2048 --json "$OUT/qad_memory.json" 2>&1 | grep -v Warning | tee "$OUT/qad.log" | tail -22
