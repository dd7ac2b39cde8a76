#!/usr/bin/env bash
# One device call: the fused Gated DeltaNet step kernel and the split attention-values
# product against the torch reference, side by side at Qwen3.5-4B shape (bench_steps.py
# --targets-only, with and without --reference-kernels, each with a kernel profile), after the
# kernels' own tests on CUDA. Random weights: exact step costs.
#   SETTINGS     latency settings (default short,medium,long)
#   INT4_KERNEL  tinygemm|triton (default triton)
#   COMPILE=1    the same two runs torch.compile'd (minutes of compilation each)
#   VARIANTS     which runs (default "reference fused"): reference (torch GDN recurrence, single
#                values GEMM), conv_in_torch (the GDN step kernel without the conv and gates
#                folded in), unfused (q/k/v, gate/up, GDN in_proj_* separate), fused (all of it),
#                magic (fused, the INT4 tensor-core path's 16-bit MAGIC + u operand: QFD_INT4_MAGIC=1),
#                magic_bm32 (the same: 32-row blocks are the default now), bm16 (17-32 rows as two
#                16-row blocks: QFD_INT4_BM32=0), gdn_chunk_verify (a verify's tokens in parallel,
#                the WY form: QFD_GDN_VERIFY=chunk), one_row_tinygemm (fused, one-row products
#                through torch's tinygemm: QFD_INT4_ONE_ROW=tinygemm), int4_head (fused, the INT4
#                target's LM head in INT4 too: --int4-head), int8_head (fused, that head in INT8: --int8-head), attn_torch (fused, the steps' attention
#                in torch - the path before the split-KV kernels: QFD_ATTENTION_KERNEL=torch), int4_pdl
#                (fused, the INT4 kernels launched with programmatic dependent launch: QFD_INT4_PDL=1),
#                int4_wfirst (fused, the INT4 tensor-core path with the weights as the dot's first operand:
#                QFD_INT4_WFIRST=1), int4_old (fused, 2+-row INT4 products through the older _int4_mm_kernel, the
#                default before 2026-12-06: QFD_INT4_MMA16=0; the others run _int4_mma_kernel, int4_mma16 the same
#                as fused), int4_mma16_all (one-row products through _int4_mma_kernel too: QFD_INT4_MMA16=all),
#                int4_prefetch (fused, each INT4 product asking the L2 for the next one's weights: QFD_INT4_PREFETCH=1),
#                rollback_per_layer (fused, the GDN rollback as two eager copies per layer, the default before
#                2026-12-07: QFD_GDN_ROLLBACK=per_layer), gdn_records (fused, a decode / verify recording
#                each token's update instead of its state: QFD_GDN_HISTORY=records), gated_mlp_off (fused,
#                the MLP's INT4 gate/up product plain and its activation a kernel of its own also for one
#                row, as before 2026-12-07's twenty-first session: QFD_GATED_MLP=0), window_channels_last
#                (fused, the GDN conv window built channels last: QFD_GDN_WINDOW=channels_last), fused_norm_off
#                (fused, every RMSNorm in torch's ops also uncompiled, as before the twenty-second session: QFD_FUSED_NORM=0),
#                fused_norm_eager (fused, the one-launch RMSNorm in the eager prefill too: QFD_FUSED_NORM=all),
#                add_norm_off (fused, a layer's residual adds apart from the norms after them, as before the
#                twenty-third session: QFD_FUSED_ADD_NORM=0), qkv_off (fused, an attention step's q/k norms, rotary,
#                K/V cache writes and output gate in torch's launches: QFD_FUSED_QKV=0), launch_cuts_off (both)
#   TESTS_K      a pytest -k expression for the kernels' tests first (TESTS_K=none: no tests)
#   INT4_AB=1    first: bench_int4_kernels.py --ab --rows 1,16,32 (each INT4 linear shape: the served
#                launch config vs the magic operand, the tensor-core path for one row, 32-row blocks;
#                INT4_AB_FLAGS: more flags, e.g. "--ab-only old,dot+mma16" - labels without spaces)
#   TREE=N       also a draft-tree verify of N tokens + keep per setting (bench_steps --tree N)
#   STEPS_S      each run's time limit (default 150); the first run gets STEPS_FIRST_S (default
#                STEPS_S + 120): on a fresh machine it compiles every kernel (and flash-linear-attention
#                autotunes) before its first figures are saved - twice a 100-130 s limit left none
export PYTHONPATH=${QFD_SRC:-$PWD}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-180}
SRC=${QFD_SRC:-$PWD}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
[ "${TESTS_K:-}" = none ] || (cd "$SRC" && timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_gdn_kernel.py tests/test_int4_triton.py tests/test_int4_dequant.py tests/test_attention_triton.py tests/test_norm_triton.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -3)
[ -z "${INT4_AB:-}" ] || timeout "${INT4_AB_S:-150}" python3 "$SRC/bench/bench_int4_kernels.py" --ab --rows 1,16,32 ${INT4_AB_FLAGS:-} --out "$OUT/int4_ab.json" 2>&1 | grep -v Warning | tee "$OUT/int4_ab.log" | tail -60
limit=${STEPS_FIRST_S:-$(( ${STEPS_S:-150} + 120 ))}
for variant in ${VARIANTS:-reference fused}; do  # VARIANTS=none: no step runs
    [ "$variant" = none ] && continue
    flags=""
    magic=0 bm32=1 verify=loop one_row=triton attention=triton pdl=0 wfirst=0 mma16=1 prefetch=0 rollback=one_launch history=states gated=1 window=channels_first norm=1 add_norm=1 qkv=1
    case $variant in magic*) magic=1 ;; esac
    [ "$variant" = bm16 ] && bm32=0
    [ "$variant" = gdn_chunk_verify ] && verify=chunk
    [ "$variant" = one_row_tinygemm ] && one_row=tinygemm
    [ "$variant" = attn_torch ] && attention=torch
    [ "$variant" = int4_pdl ] && pdl=1
    [ "$variant" = int4_wfirst ] && wfirst=1
    [ "$variant" = int4_old ] && mma16=0
    case $variant in magic*|int4_wfirst) mma16=0 ;; esac  # the older kernel's own options
    [ "$variant" = int4_mma16_all ] && mma16=all
    [ "$variant" = int4_prefetch ] && prefetch=1
    [ "$variant" = rollback_per_layer ] && rollback=per_layer
    [ "$variant" = gdn_records ] && history=records
    [ "$variant" = gated_mlp_off ] && gated=0
    [ "$variant" = window_channels_last ] && window=channels_last
    [ "$variant" = fused_norm_off ] && norm=0
    [ "$variant" = fused_norm_eager ] && norm=all
    case $variant in qkv_off|launch_cuts_off) qkv=0 ;; esac
    case $variant in add_norm_off|launch_cuts_off) add_norm=0 ;; esac
    [ "$variant" = reference ] && flags="--reference-kernels"
    [ "$variant" = conv_in_torch ] && flags="--no-fused-conv"
    [ "$variant" = unfused ] && flags="--no-fuse"
    [ "$variant" = int4_head ] && flags="--int4-head"
    [ "$variant" = int8_head ] && flags="--int8-head"
    QFD_INT4_MAGIC=$magic QFD_INT4_BM32=$bm32 QFD_GDN_VERIFY=$verify QFD_INT4_ONE_ROW=$one_row QFD_ATTENTION_KERNEL=$attention QFD_INT4_PDL=$pdl QFD_INT4_WFIRST=$wfirst QFD_INT4_MMA16=$mma16 QFD_INT4_PREFETCH=$prefetch QFD_GDN_ROLLBACK=$rollback QFD_GDN_HISTORY=$history QFD_GATED_MLP=$gated QFD_GDN_WINDOW=$window QFD_FUSED_NORM=$norm QFD_FUSED_ADD_NORM=$add_norm QFD_FUSED_QKV=$qkv timeout "$limit" python3 "$SRC/bench/bench_steps.py" --device cuda --targets-only --profile --settings "${SETTINGS:-short,medium,long}" \
        --int4-kernel "${INT4_KERNEL:-triton}" ${COMPILE:+--compile} ${TREE:+--tree $TREE} $flags --out "$OUT/targets_$variant.json" 2>&1 | grep -v Warning > "$OUT/targets_$variant.log"
    grep -A12 "target step costs" "$OUT/targets_$variant.log"
    grep -A6 "draft-tree verify" "$OUT/targets_$variant.log"
    grep "us of kernels\|fell back" "$OUT/targets_$variant.log"
    limit=${STEPS_S:-150}
done
