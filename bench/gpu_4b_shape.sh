#!/usr/bin/env bash
# One device call (H200): the Qwen3.5-4B-shape step costs and projected speedup
# (bench_steps.py), then the QAD memory plan (bench_qad_memory.py). Random weights: exact
# step costs and memory, no quality. Each part is time-boxed; both write JSON under $OUT.
#   SETTINGS   latency settings to time (default short,medium,long)
#   COMPILE=1  time the steps again with --compile (torch.compile before CUDA-graph capture),
#              side by side in the same call (steps_compiled.json)
#   QAD_S=0    skip the QAD memory plan
#   KERNELS=1  first: the INT4 matmul kernels side by side (KERNELS_SWEEP=1: with a launch-config sweep,
#              whose best configs become the GPU's tuned table for the steps that follow)
#              (bench_int4_kernels.py, int4_kernels.json) and the Triton kernel's tests (KERNELS_TESTS=0: none;
#              KERNELS_FLAGS: more bench_int4_kernels.py flags, e.g. "--sweep-grid split --rows 1 --shapes fused,down_proj")
#   INT4_KERNEL=tinygemm|triton   the INT4 kernel the steps run (default: Int4Linear's)
#   UNCOMPILED=0  skip the uncompiled steps (with COMPILE=1: only the compiled ones)
#   STEPS_FLAGS="..."  more bench_steps.py flags (e.g. --no-compile-drafter, --targets-only)
#   PROFILE=1  also a kernel breakdown of the targets' decode and verify (bench_steps --profile)
#   TESTS=1    first: the Triton kernels' tests on CUDA (INT4 matmul, Gated DeltaNet step/tree/chunk, dequant;
#              TESTS_K: a pytest -k expression to run some of them)
#   PREFILL_PROFILE=1  then: kernel profiles of an 8K-token eager prefill, qfd's own chunked Gated DeltaNet
#              beside flash-linear-attention's where installed (bench/profile_prefill.py; PREFILL_FLAGS, e.g. --int4)
#   INT4_AB=1  then: the INT4 matmul's variants side by side (bench_int4_kernels.py --ab on the fused
#              and drafter shapes, 1/16/32 rows); the steps below run with the variants that won
#              (QFD_INT4_MAGIC / QFD_INT4_BM32 / QFD_INT4_MMA16, printed)
export PYTHONPATH=${QFD_SRC:-$PWD}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SRC=${QFD_SRC:-$PWD}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
if [ -n "${TESTS:-}" ]; then
    (cd "$SRC" && timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_int4_triton.py tests/test_gdn_kernel.py tests/test_int4_dequant.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -3)
fi
if [ -n "${PREFILL_PROFILE:-}" ]; then
    COLUMNS=160 timeout "${PREFILL_S:-150}" python3 "$SRC/bench/profile_prefill.py" --tokens 8192 ${PREFILL_FLAGS:-} --out "$OUT/prefill_profile.json" 2>&1 | grep -v Warning | tee "$OUT/prefill_profile.log" | grep -A14 "prefill of"
fi
if [ -n "${INT4_AB:-}" ]; then
    COLUMNS=180 timeout "${INT4_AB_S:-120}" python3 "$SRC/bench/bench_int4_kernels.py" --ab --rows 1,16,32 --shapes "${INT4_AB_SHAPES:-fused,drafter}" \
        --out "$OUT/int4_ab.json" 2>&1 | grep -v Warning | tee "$OUT/int4_ab.log" | grep -A40 "INT4 kernel variants"
    knobs=$(python3 "$SRC/bench/bench_int4_kernels.py" --ab-knobs "$OUT/int4_ab.json") && eval "$knobs" && echo "steps run with: $knobs"
fi
if [ -n "${KERNELS:-}" ]; then
    [ "${KERNELS_TESTS:-1}" = 0 ] || (cd "$SRC" && timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_int4_triton.py 2>&1 | tail -3)
    # a sweep writes the GPU's tuned launch configs into this tree copy (the steps below use
    # them) and into $OUT (commit it as qfd/kernels/tuned/<GPU>.json)
    timeout "${KERNELS_S:-200}" python3 "$SRC/bench/bench_int4_kernels.py" ${KERNELS_SWEEP:+--sweep --write-tuned} ${KERNELS_FLAGS:-} --out "$OUT/int4_kernels.json" 2>&1 | grep -v Warning | tee "$OUT/int4_kernels.log" | tail -30
    [ -z "${KERNELS_SWEEP:-}" ] || cp "$SRC"/qfd/kernels/tuned/*.json "$OUT/" 2>/dev/null
fi
steps() {  # steps NAME [FLAGS...]
    name=$1; shift
    timeout "${STEPS_S:-140}" python3 "$SRC/bench/bench_steps.py" --device cuda --settings "${SETTINGS:-short,medium,long}" ${INT4_KERNEL:+--int4-kernel $INT4_KERNEL} ${PROFILE:+--profile} ${STEPS_FLAGS:-} "$@" \
        --out "$OUT/$name.json" 2>&1 | grep -v Warning | tee "$OUT/$name.log" | tail -40
}
[ "${UNCOMPILED:-1}" = 0 ] || steps steps
[ -z "${COMPILE:-}" ] || steps steps_compiled --compile
[ "${QAD_S:-75}" = 0 ] || timeout "${QAD_S:-75}" python3 "$SRC/bench/bench_qad_memory.py" --steps 2 --seq-len 2048 --json "$OUT/qad_memory.json" 2>&1 | grep -v Warning | tee "$OUT/qad.log" | tail -22
