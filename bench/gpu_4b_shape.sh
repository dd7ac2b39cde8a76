#!/usr/bin/env bash
# One device call (H200): the Qwen3.5-4B-shape step costs and projected speedup
# (bench_steps.py), then the QAD memory plan (bench_qad_memory.py). Random weights: exact
# step costs and memory, no quality. Each part is time-boxed; both write JSON under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
timeout "${STEPS_S:-140}" python3 bench/bench_steps.py --device cuda --out "$OUT/steps.json" 2>&1 | grep -v Warning | tee "$OUT/steps.log" | tail -40
timeout "${QAD_S:-75}" python3 bench/bench_qad_memory.py --steps 2 --seq-len 2048 --json "$OUT/qad_memory.json" 2>&1 | grep -v Warning | tee "$OUT/qad.log" | tail -22
