#!/usr/bin/env bash
# One device call for the two-slot one-row INT4 kernel (`_int4_gemv_two_slot_kernel`), most
# valuable first (a call cut short still returns what ran):
#   1. the one-row sweep of its configs beside each shape's served config (bench_int4_kernels.py
#      --sweep-grid two_slot --write-tuned: the tuned table keeps the faster per shape);
#   2. graphed, uncompiled targets-only steps (short) with that table, with a kernel profile;
#   3. the same steps with the table as committed (same machine: the A/B);
#   4. the kernel's tests and the INT8 head's on CUDA.
# Wheels under .whl/ (flash-linear-attention, fla-core) are installed first when present.
# Results under $OUT (the device tool's output folder; default ./gpu_two_slot_out).
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_two_slot_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p /tmp/tuned_as_committed && cp qfd/kernels/tuned/*.json /tmp/tuned_as_committed/
date -u +%H:%M:%S
timeout 180 python3 bench/bench_int4_kernels.py --rows 1 --sweep --sweep-grid two_slot --write-tuned \
    --shapes fused,o_proj,out_proj,down_proj,drafter,in_proj_z --out "$OUT/int4_two_slot_sweep.json" > "$OUT/sweep.log" 2>&1
tail -22 "$OUT/sweep.log"
cp qfd/kernels/tuned/*.json "$OUT/"
date -u +%H:%M:%S
timeout 100 python3 bench/bench_steps.py --device cuda --settings short --int4-kernel triton --targets-only --profile \
    --out "$OUT/steps_new_table.json" > "$OUT/steps_new_table.log" 2>&1
grep -E "decode_short_ms|verify_short_ms|verify_rollback_short_ms|_int4_|gemv" "$OUT/steps_new_table.log" | head -30
cp /tmp/tuned_as_committed/*.json qfd/kernels/tuned/
date -u +%H:%M:%S
timeout 90 python3 bench/bench_steps.py --device cuda --settings short --int4-kernel triton --targets-only \
    --out "$OUT/steps_old_table.json" > "$OUT/steps_old_table.log" 2>&1
grep -E "decode_short_ms|verify_short_ms|verify_rollback_short_ms" "$OUT/steps_old_table.log"
date -u +%H:%M:%S
timeout 60 python3 -m pytest -q tests/test_int4_triton.py -k "two_slot or gated" 2>&1 | tail -4
timeout 60 python3 -m pytest -q tests/test_int8_head.py 2>&1 | tail -4
date -u +%H:%M:%S
