#!/usr/bin/env bash
# Device call 1 of 2: keep the first GGUF part outside the checkout, then the random-weight
# Qwen3.5-4B-shape measurements (step costs + projection; QAD memory plan).
mkdir -p ~/g && cp .carry/p0/gguf.part00 ~/g/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
timeout 330 python bench/bench_steps.py --device cuda --out $OUT/steps.json 2>&1 | tail -30
timeout 220 python bench/bench_qad_memory.py --steps 3 --json $OUT/qad_memory.json 2>&1 | tail -25
