"""bench/sass_int4.py's SASS reading (pure Python; compiling needs triton, skipped without it)
and bench_int4_kernels.py's choice of INT4 variants from an --ab run and its mma16 sweep grid."""
import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from sass_int4 import main_loop_stats  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                      /* 0x00000a0000017a02 */
        /*0010*/                   LOP3.LUT R2, R2, 0xf, RZ, 0xc0, !PT ;       /* 0x0000000f02027812 */
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;       /* 0x0000000c0804723c */
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;               /* 0x0000000000007b1d */
        /*0040*/               @P0 BRA 0x10 ;                                  /* 0xfffffffc00c80947 */
        /*0050*/                   ATOMG.E.ADD.STRONG.GPU PT, R3, [R4], R5 ;   /* 0x000000050403798a */
        /*0060*/              @!P1 BRA 0x50 ;                                  /* 0xfffffffc00c88947 */
        /*0070*/                   EXIT ;                                      /* 0x000000000000794d */
"""


def test_the_main_loop_is_the_longest_backward_branch():
    loop = main_loop_stats(SASS)
    # 0x10..0x40 (four instructions) beats the two-instruction 0x50..0x60 loop
    assert loop.instructions == 4
    assert loop.opcodes == {"LOP3": 1, "HMMA": 1, "BAR": 1, "BRA": 1}
    assert loop.count("BAR", "STS") == 1


def test_code_without_a_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop"):
        main_loop_stats(SASS.replace("@P0 BRA 0x10", "NOP").replace("@!P1 BRA 0x50", "NOP"))


def test_the_ab_run_keeps_each_default_unless_its_alternative_was_timed_faster():
    from bench_int4_kernels import ab_knobs

    def rows(mma16, old_16, old_32=None, more=None):  # the served config is the default, `_int4_mma_kernel`
        out = [{"m": 16, "variants": {"served": {"us": mma16}, "mma16": {"us": mma16}, "old": {"us": old_16}}}]
        out.append({"m": 32, "variants": {"served": {"us": mma16}, "mma16": {"us": mma16}, **({"old": {"us": old_32}} if old_32 else {})}})
        for (m, label), us in (more or {}).items():
            out[0 if m == 16 else 1]["variants"][label] = {"us": us}
        return out

    assert ab_knobs(rows(8.0, 10.0, 10.0))["QFD_INT4_MMA16"] == 1
    assert ab_knobs(rows(10.0, 9.9, 9.9))["QFD_INT4_MMA16"] == 1  # inside the 3% margin: the default holds
    assert ab_knobs(rows(10.0, 8.0, 8.0))["QFD_INT4_MMA16"] == 0
    # the old kernel timed at 16 rows only: compared with the new one at 16 rows, not the 16 + 32 sum
    assert ab_knobs(rows(10.0, 8.0))["QFD_INT4_MMA16"] == 0
    assert ab_knobs(rows(10.0, 12.0))["QFD_INT4_MMA16"] == 1
    # nothing to compare (an --ab-only run without them): the defaults
    assert ab_knobs([{"m": 16, "variants": {"served": {"us": 1.0}}}]) == {"QFD_INT4_MAGIC": 0, "QFD_INT4_BM32": 1, "QFD_INT4_MMA16": 1}
    # two 16-row blocks only where they beat the served 32-row block; the magic operand where it beats the old kernel's
    assert ab_knobs(rows(10.0, 12.0, 12.0, {(32, "bm16"): 9.0}))["QFD_INT4_BM32"] == 0
    assert ab_knobs(rows(10.0, 12.0, 12.0, {(32, "bm16"): 11.0}))["QFD_INT4_BM32"] == 1
    assert ab_knobs(rows(10.0, 12.0, 12.0, {(16, "magic"): 10.0, (32, "magic"): 10.0}))["QFD_INT4_MAGIC"] == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiling needs triton (not on CI), and not its interpreter")
def test_the_mma16_kernel_compiles_to_fewer_instructions_per_weight_than_the_served_one():
    """A static property of the machine code (sm_90), not a timing: the reason the kernel exists."""
    from sass_int4 import study

    rows = study([16], "NVIDIA H100 80GB HBM3", 90, (("fused mlp gate_up", 18432, 2560),))
    per_weight = {r["form"]: r["instructions_per_weight"] for r in rows}
    barriers = {r["form"]: r["barriers_per_trip"] for r in rows}
    assert per_weight["mma16"] < 0.8 * per_weight["old"]
    assert barriers["mma16"] < barriers["old"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiling needs triton (not on CI), and not its interpreter")
def test_the_two_slot_gemv_compiles_to_fewer_instructions_per_weight_than_the_served_one_row_kernel():
    """Static (sm_90), not a timing: the two-slot kernel's reason to exist - 3 shifts per 8
    weights instead of 7, x as bf16 pairs, no cross-thread sum of x."""
    from sass_int4 import study

    rows = study([1], "NVIDIA H100 80GB HBM3", 90, (("mlp down_proj", 2560, 9216),))
    per_weight = {r["form"]: r["instructions_per_weight"] for r in rows}
    assert per_weight["two-slot gemv"] < 0.85 * per_weight["served (gemv)"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiling needs triton (not on CI), and not its interpreter")
@pytest.mark.parametrize("arch", [80, 86, 89])
def test_every_int4_kernel_form_compiles_for_ampere_and_ada(arch):
    """The paper's GPU is an A10G (sm_86), and no A10G, A100 or L4 has run these kernels: every
    form (the served one-row and 16-row kernels, the two-slot gemv, the tensor-core kernel) builds
    for those architectures at the heuristic configs a GPU without a tuned table gets, its loop
    found and its shared memory within the A10G's 99 KB per block (and the H100 table's one-row
    gemv configs, for the `_int4_gemv_kernel` the heuristic does not pick)."""
    from sass_int4 import study

    shapes = (("mlp down_proj", 2560, 9216), ("gdn in_proj_qkv", 8192, 2560))
    rows = study([1, 16], "a GPU without a tuned table", arch, shapes) + study([1], "NVIDIA H100 80GB HBM3", arch, shapes[:1])
    assert {r["form"] for r in rows} >= {"served", "served (gemv)", "two-slot gemv", "mma16 (16-row block)", "old", "mma16"}
    for r in rows:
        assert r["loop_instructions"] > 0 and r["shared_bytes"] <= 99 * 1024, r


def test_the_mma16_sweep_grid_adds_the_new_kernel_beside_the_served_splits():
    from bench_int4_kernels import sweep_configs

    for rows in (1, 16):
        split = list(sweep_configs(rows, "split"))
        grid = list(sweep_configs(rows, "mma16"))
        # the served splits, pinned to the older kernel where they use tensor cores (the default is the new one)
        assert grid[: len(split)] == [replace(c, mma16=False) if c.use_dot else c for c in split]
        extra = grid[len(split):]
        assert extra and all(c.mma16 and c.use_dot for c in extra)


def test_the_sweep_at_32_rows_tries_32_row_blocks_as_the_served_heuristic_runs_them():
    from bench_int4_kernels import sweep_configs

    assert {c.block_m for c in sweep_configs(32, "mma16")} == {32}
    assert {c.block_m for c in sweep_configs(16, "mma16") if c.use_dot} == {16}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiling needs triton (not on CI), and not its interpreter")
def test_the_gated_epilogue_leaves_each_main_loop_as_it_was():
    """bench/sass_fusions.py: silu(gate) * up is computed after the K loop, once per tile (sm_90)."""
    from sass_fusions import gated_study

    for row in gated_study("NVIDIA H100 80GB HBM3", 90, rows=(1, 16)):
        if row["form"].startswith(("served", "mma16")):  # the forms the defaults run
            assert row["gated"]["loop_instructions"] == row["plain"]["loop_instructions"]
            assert row["gated"]["registers"] <= row["plain"]["registers"] + 2
            assert row["gated"]["instructions"] > row["plain"]["instructions"]  # the epilogue is there


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiling needs triton (not on CI), and not its interpreter")
def test_the_gated_tensor_core_store_writes_vectors_not_one_value_at_a_time():
    """The twenty-second session's ncu finding: split out of the interleaved tile, the output
    columns compiled to eight 2-byte stores per thread and the 32-row product ran 1.3x longer."""
    from sass_fusions import gated_study

    for row in gated_study("NVIDIA H100 80GB HBM3", 90, rows=(16, 32)):
        if row["form"].startswith("mma16"):
            assert "STG.E.U16" not in row["gated"]["stores"], row


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiling needs triton (not on CI), and not its interpreter")
def test_a_channels_last_window_is_read_in_wide_loads():
    """bench/sass_fusions.py: the GDN conv-step kernel reads a channels-last window's taps in
    128-bit loads, where channels first takes one 16-bit load per element (sm_90)."""
    from sass_fusions import window_study

    rows = {(r["tokens"], r["layout"]): r["global_loads"] for r in window_study(90, tokens=(16,))}
    first, last = rows[(16, "channels first")], rows[(16, "channels last")]
    assert last.get("LDG.E.128", 0) > first.get("LDG.E.128", 0)
    assert last.get("LDG.E.U16", 0) < first.get("LDG.E.U16", 0) / 4
