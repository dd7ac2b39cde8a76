#!/usr/bin/env bash
# Device call 3: first GGUF part to ~/g, then the 4B-shape step costs again (INT4 verify via tinygemm).
mkdir -p ~/g && cp .carry/p0/gguf.part00 ~/g/
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python bench/bench_steps.py --device cuda --out $OUT/steps.json 2>&1 | tail -45
