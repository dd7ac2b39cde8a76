"""qfd's Triton W4A16 kernel: its packed layout, its torch op, and Int4Linear's "triton" mode.

The layout, the float32 reference and the op's plumbing (Int4Linear, torch.compile's fake
kernel) run on any CPU: without Triton the op computes `reference_matmul` on the packed
layout. The kernel itself runs where Triton does: on a GPU, or on a CPU under Triton's
interpreter (TRITON_INTERPRET=1, Triton installed); CI has no Triton, so those tests skip
there. bench/bench_int4_kernels.py checks the kernel on the H200 (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace

import pytest
import torch

from qfd.kernels import int4_configs, int4_layout, int4_triton
from qfd.quant.grid import dequantize, rtn_quantize
from qfd.quant.int4_linear import Int4Linear, cuda_kernel_choice, one_row_kernel, tinygemm_operands_from_triton
from qfd.quant.types import QuantizedWeight


def weight(n, k, group=128, symmetric=True, seed=0):
    torch.manual_seed(seed)
    return rtn_quantize(torch.randn(n, k) * 0.05, group, symmetric=symmetric, scale_dtype=torch.float32)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group", [(40, 256, 128), (24, 320, 64), (16, 96, 32), (8, 512, 256)])
def test_layout_round_trips_and_dequantizes_exactly(n, k, group, symmetric):
    qw = weight(n, k, group, symmetric)
    packed = int4_layout.pack_for_triton(qw)
    assert packed.padded_in % int4_layout.TILE_K == 0 and packed.padded_in >= k
    u = qw.codes.to(torch.int32) + (8 if symmetric else 0)
    assert torch.equal(int4_layout.unpack_codes(packed), u)
    assert torch.equal(int4_layout.dequantize_packed(packed), dequantize(qw, torch.float32))


def test_a_words_nibbles_j_and_j_plus_4_are_k_neighbours():
    """The layout's contract with `_int4_mma_kernel`: (word >> 4j) & 0x000F000F holds the codes of
    k = 128t + 32j + 2p and k + 1 in its two 16-bit halves (row 16t + p, j < 4)."""
    qw = weight(8, 256, 128)
    packed = int4_layout.pack_for_triton(qw)
    u = int4_layout.unpack_codes(packed)  # [N, K]
    words = packed.qweight.to(torch.int64) & 0xFFFFFFFF
    for t in range(2):
        for p in range(16):
            for j in range(4):
                pair = (words[16 * t + p] >> (4 * j)) & 0x000F000F
                k = 128 * t + 32 * j + 2 * p
                assert torch.equal(pair & 0xF, u[:, k].to(torch.int64)) and torch.equal(pair >> 16, u[:, k + 1].to(torch.int64))


def test_reference_matmul_is_the_dequantized_product():
    qw = weight(48, 384, 128)
    x = torch.randn(5, 384)
    packed = int4_layout.pack_for_triton(qw)
    torch.testing.assert_close(int4_layout.reference_matmul(x, packed), x @ dequantize(qw, torch.float32).t(), rtol=1e-5, atol=1e-5)


def test_pack_rejects_what_the_layout_cannot_hold():
    qw = weight(8, 96, 96)
    with pytest.raises(ValueError, match="group size"):
        int4_layout.pack_for_triton(qw)
    # zero points past 128 (never a 4-bit format's): MAGIC + z would not be exact in bf16
    qw = weight(8, 128, 128, symmetric=False)
    qw.zeros[0, 0] = 129
    with pytest.raises(ValueError, match="0..128"):
        int4_layout.pack_for_triton(qw)
    qw.zeros[0, 0] = 128
    int4_layout.pack_for_triton(qw)


@pytest.mark.parametrize("rows", [1, 16, 40, 300])
def test_int4linear_triton_mode_matches_the_dense_layer(rows):
    qw = weight(64, 256, 128)
    layer = Int4Linear(qw, kernel="triton")
    assert layer.mode == "triton"
    x = torch.randn(2, rows, 256)
    expected = torch.nn.functional.linear(x, dequantize(qw, torch.float32))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group", [(40, 256, 128), (24, 320, 64), (16, 96, 32)])
def test_tinygemm_operands_rebuilt_from_the_triton_layout_give_the_same_weight(n, k, group, symmetric):
    """QFD_INT4_ONE_ROW=tinygemm rebuilds tinygemm's operands from a (fused) Triton layer's
    buffers: (u - 8) * scale + zero must be w_hat exactly, padding of K cut off."""
    qw = weight(n, k, group, symmetric)
    packed = int4_layout.pack_for_triton(qw)
    u, sz = tinygemm_operands_from_triton(packed.qweight, packed.scales, packed.zeros, group, k)
    assert u.shape == (n, k) and int(u.min()) >= 0 and int(u.max()) <= 15 and sz.shape == (k // group, n, 2)
    scale = sz[..., 0].t().repeat_interleave(group, 1)
    zero = sz[..., 1].t().repeat_interleave(group, 1)
    torch.testing.assert_close((u.float() - 8) * scale + zero, dequantize(qw, torch.float32), rtol=0, atol=1e-7)


def test_one_row_kernel_reads_the_environment(monkeypatch):
    monkeypatch.delenv("QFD_INT4_ONE_ROW", raising=False)
    assert one_row_kernel() == "triton"
    monkeypatch.setenv("QFD_INT4_ONE_ROW", "tinygemm")
    assert one_row_kernel() == "tinygemm"
    monkeypatch.setenv("QFD_INT4_ONE_ROW", "marlin")
    with pytest.raises(ValueError, match="QFD_INT4_ONE_ROW"):
        one_row_kernel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tinygemm's CUDA kernel")
def test_one_row_products_through_tinygemm_match_triton_also_fused(monkeypatch):
    monkeypatch.setenv("QFD_INT4_ONE_ROW", "tinygemm")
    parts = [Int4Linear(weight(n, 512, 128, symmetric=False, seed=n), device="cuda", dtype=torch.bfloat16, kernel="triton") for n in (128, 96)]
    fused = Int4Linear.concatenated(parts)
    for layer in (*parts, fused):
        assert layer.mode == "triton" and layer.one_row_packed is not None
        x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
        one_row = layer(x)  # tinygemm
        triton_y = layer._triton_matmul(x)
        torch.testing.assert_close(one_row.float(), triton_y.float(), rtol=2e-2, atol=2e-2 * triton_y.abs().max().item())
        torch.testing.assert_close(layer(x.expand(3, -1)).float(), triton_y.expand(3, -1).float(), rtol=2e-2, atol=2e-2 * triton_y.abs().max().item())
    # a gated pair's one row: tinygemm's interleaved product, then torch's activation
    gate, up = (Int4Linear(weight(64, 512, 128, symmetric=False, seed=seed), device="cuda", dtype=torch.bfloat16, kernel="triton") for seed in (1, 2))
    pair = Int4Linear.gated_pair(gate, up)
    assert pair.one_row_packed is not None
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    in_kernel = pair._triton_matmul(x, gated=True)
    torch.testing.assert_close(pair(x).float(), in_kernel.float(), rtol=2e-2, atol=2e-2 * in_kernel.abs().max().item())


def test_the_op_compiles_as_one_opaque_call():
    qw = weight(32, 128, 128)
    layer = Int4Linear(qw, kernel="triton")
    x = torch.randn(3, 128)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_gated_pair_compiles_in_one_graph(rows):
    """A gate/up pair (`Int4Linear.gated_pair`) traces whole: the op's fake kernel gives the
    gated product's half-width output (one row), torch's activation follows the plain one (more)."""
    gate, up = (Int4Linear(weight(32, 128, 128, seed=seed), kernel="triton") for seed in (1, 2))
    pair = Int4Linear.gated_pair(gate, up)
    x = torch.randn(rows, 128)
    compiled = torch.compile(pair, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    assert got.shape == (rows, 32)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate(x)) * up(x), rtol=1e-5, atol=1e-5)


def test_kernel_choice_reads_the_argument_then_the_environment(monkeypatch):
    monkeypatch.setenv("QFD_INT4_KERNEL", "triton")
    assert cuda_kernel_choice() == "triton"
    assert cuda_kernel_choice("tinygemm") == "tinygemm"
    monkeypatch.setenv("QFD_INT4_KERNEL", "marlin")
    with pytest.raises(ValueError, match="QFD_INT4_KERNEL"):
        cuda_kernel_choice()
    # on a CPU the environment's choice does not move a layer off the CPU kernel
    monkeypatch.setenv("QFD_INT4_KERNEL", "triton")
    assert Int4Linear(weight(16, 128), dtype=torch.bfloat16, kernel=None).mode == "cpu_int4"


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the Triton kernel needs Triton and a GPU, or TRITON_INTERPRET=1 (not on CI)",
)


@needs_triton
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("w_first", [False, True])
def test_kernel_matches_the_reference(rows, symmetric, split_k, w_first):
    """Also with the weights as the dot's first operand (rows > 1: y.T = w @ x.T)."""
    if w_first and rows == 1:
        pytest.skip("one row takes the CUDA-core path: no dot")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    qw = weight(80, 512, 128, symmetric)
    packed = int4_layout.pack_for_triton(qw, device)
    x = torch.randn(rows, 512, device=device)
    bias = torch.randn(80, device=device)
    config = int4_configs.KernelConfig(use_dot=rows > 1, block_n=32, split_k=split_k, w_first=w_first)
    got = int4_triton.int4_matmul(x, packed, bias, config=config)
    torch.testing.assert_close(got, int4_layout.reference_matmul(x, packed, bias), rtol=1e-4, atol=1e-4)
    assert int(packed.counters.abs().sum()) == 0  # split-K leaves its counters at zero for the next launch


@needs_triton
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("offset_sum", [False, True])
@pytest.mark.parametrize("k,group,tiles,split_k", [(384, 128, 1, 1), (384, 128, 2, 2), (512, 256, 4, 1), (1024, 128, 2, 3)])
def test_one_row_gemv_kernel_matches_the_reference(symmetric, offset_sum, k, group, tiles, split_k):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    qw = weight(72, k, group, symmetric)
    packed = int4_layout.pack_for_triton(qw, device)
    x = torch.randn(1, k, device=device)
    bias = torch.randn(72, device=device)
    config = int4_configs.KernelConfig(use_dot=False, block_n=32, split_k=split_k, tiles=tiles, offset_sum=offset_sum)
    got = int4_triton.int4_matmul(x, packed, bias, config=config)
    torch.testing.assert_close(got, int4_layout.reference_matmul(x, packed, bias), rtol=1e-4, atol=1e-4)
    assert int(packed.counters.abs().sum()) == 0



@needs_triton
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group,tiles,split_k,block_n", [
    (72, 384, 128, 1, 1, 32), (72, 384, 128, 2, 2, 32), (64, 512, 256, 2, 1, 64), (96, 1024, 128, 1, 3, 32), (40, 640, 128, 2, 2, 32)])
def test_the_two_slot_one_row_kernel_matches_the_reference(symmetric, n, k, group, tiles, split_k, block_n):
    """`_int4_gemv_two_slot_kernel` (bf16 x) with zero points or without, partial output blocks
    (72 outputs in blocks of 32), steps past K (5 tiles, 2 a step), split K: the float32 product of
    the same bf16 x to within the output's bf16 rounding. A nibble read from the wrong slot or
    paired with the wrong x is off by the size of the output."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed = int4_layout.pack_for_triton(weight(n, k, group, symmetric), device, scale_dtype=torch.bfloat16)
    torch.manual_seed(1)
    x = (torch.randn(1, k, device=device) * 3).to(torch.bfloat16)
    bias = torch.randn(n, device=device).to(torch.bfloat16)
    config = int4_configs.KernelConfig(use_dot=False, block_n=block_n, split_k=split_k, tiles=tiles, two_slot=True)
    got = int4_triton.int4_matmul(x, packed, bias, config=config)
    want = int4_layout.reference_matmul(x.float(), packed, bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * float(want.abs().max()))
    assert int(packed.counters.abs().sum()) == 0


class _LaunchSpy:
    """Stands in for a Triton kernel: counts launches, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@needs_triton
def test_two_slot_takes_bf16_pairs_and_otherwise_runs_the_plain_gemv(monkeypatch):
    """The two-slot kernel reads x as aligned bf16 pairs: fp32 x or bf16 x at a 2-byte offset
    run `_int4_gemv_kernel` instead, exactly as the config without two_slot would."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spy = _LaunchSpy(int4_triton._int4_gemv_two_slot_kernel)
    monkeypatch.setattr(int4_triton, "_int4_gemv_two_slot_kernel", spy)
    packed = int4_layout.pack_for_triton(weight(64, 256, 128), device, scale_dtype=torch.bfloat16)
    config = int4_configs.KernelConfig(use_dot=False, block_n=32, split_k=2, tiles=1, two_slot=True)
    plain = int4_configs.KernelConfig(use_dot=False, block_n=32, split_k=2, tiles=1)
    torch.manual_seed(2)
    wide = torch.randn(1, 257, device=device).to(torch.bfloat16)
    int4_triton.int4_matmul(wide[:, :256], packed, config=config)
    assert spy.launches == 1
    shifted = wide[:, 1:]  # 2 bytes past a 4-byte boundary
    x32 = torch.randn(1, 256, device=device)
    for x in (shifted, x32):
        assert torch.equal(int4_triton.int4_matmul(x, packed, config=config), int4_triton.int4_matmul(x, packed, config=plain))
    assert spy.launches == 1


def test_the_two_slot_knob_sends_every_one_row_config_to_it(monkeypatch):
    """QFD_INT4_GEMV=two_slot: one-row products keep their config's outputs per program and K
    split, through the two-slot kernel (a tensor-core or `_int4_mm_kernel` entry: 1 tile a
    step); more rows are untouched."""
    monkeypatch.setattr(int4_configs, "GEMV_TWO_SLOT", True)
    base = int4_configs.heuristic_config(1, 512, 256)
    cfg = int4_configs.pick_config(1, 512, 256, torch.device("cpu"))
    assert cfg == int4_configs.as_two_slot(base) == replace(base, tiles=1, two_slot=True) and not cfg.use_dot
    assert int4_configs.pick_config(16, 512, 256, torch.device("cpu")) == int4_configs.heuristic_config(16, 512, 256)


def test_pick_config_reads_the_gpus_tuned_table(tmp_path, monkeypatch):
    monkeypatch.setattr(int4_configs, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(int4_configs, "_current_device_name", lambda index: "NVIDIA Test GPU")
    int4_configs.tuned_configs.cache_clear()
    entry = {"m": 1, "n": 512, "k": 256, "us": 3.0, "use_dot": False, "block_n": 128, "split_k": 2, "num_warps": 8, "num_stages": 3, "tiles": 2, "offset_sum": True}
    tree = {"m": 32, "n": 512, "k": 256, "us": 4.0, "use_dot": True, "block_n": 64, "split_k": 2, "block_m": 32, "mma16": True}
    int4_configs.tuned_file("NVIDIA Test GPU").write_text(__import__("json").dumps({"device": "NVIDIA Test GPU", "configs": [entry, tree]}))
    cuda = torch.device("cuda", 0)
    try:
        assert int4_configs.pick_config(1, 512, 256, cuda) == int4_configs.KernelConfig(use_dot=False, block_n=128, split_k=2, num_warps=8, num_stages=3, tiles=2, offset_sum=True)
        # 17-32 rows (a 32-node tree verify): the m = 32 entry, with 32-row blocks only
        assert int4_configs.pick_config(24, 512, 256, cuda) == int4_configs.KernelConfig(use_dot=True, block_n=64, split_k=2, block_m=32, mma16=True)
        # QFD_INT4_MMA16=0 (read at import into MMA16) holds over a tuned entry's mma16
        monkeypatch.setattr(int4_configs, "MMA16", False)
        assert int4_configs.pick_config(24, 512, 256, cuda).mma16 is False
        monkeypatch.setattr(int4_configs, "BLOCK_M_32", False)
        assert int4_configs.pick_config(24, 512, 256, cuda) == int4_configs.heuristic_config(24, 512, 256)
        # another shape, more rows, or a CPU tensor: the heuristic
        assert int4_configs.pick_config(1, 1024, 256, cuda) == int4_configs.heuristic_config(1, 1024, 256)
        assert int4_configs.pick_config(40, 512, 256, cuda) == int4_configs.heuristic_config(40, 512, 256)
        assert int4_configs.pick_config(1, 512, 256, torch.device("cpu")) == int4_configs.heuristic_config(1, 512, 256)
    finally:
        int4_configs.tuned_configs.cache_clear()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows,block_m,group,split_k", [(1, 16, 128, 1), (16, 16, 128, 2), (32, 32, 64, 1), (40, 16, 256, 2)])
@pytest.mark.parametrize("w_first", [False, True])
def test_magic_operand_matches_the_exact_operand(dtype, symmetric, rows, block_m, group, split_k, w_first):
    """The 16-bit MAGIC + u weight operand with its per-group offset taken off gives the
    product the exact (q - z) operand gives, to the 16-bit output's rounding."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (either operand): GPU only")
    qw = weight(96, 512, group, symmetric)
    packed = int4_layout.pack_for_triton(qw, device, scale_dtype=dtype)
    x = torch.randn(rows, 512, device=device).to(dtype)
    bias = torch.randn(96, device=device).to(dtype)
    # pinned to `_int4_mm_kernel` (mma16=False): the magic operand is that kernel's, and 16-bit x
    # goes to `_int4_mma_kernel` by default
    base = int4_configs.KernelConfig(use_dot=True, block_n=32, split_k=split_k, block_m=block_m, magic=False, w_first=w_first, mma16=False)
    exact = int4_triton.int4_matmul(x, packed, bias, config=base)
    got = int4_triton.int4_matmul(x, packed, bias, config=int4_configs.KernelConfig(**{**vars(base), "magic": True}))
    reference = int4_layout.reference_matmul(x.float(), packed, bias.float())
    assert (got.float() - reference).abs().max() <= (exact.float() - reference).abs().max() * 1.5 + 2e-2
    torch.testing.assert_close(got.float(), exact.float(), rtol=2e-2, atol=2e-2)
    assert int(packed.counters.abs().sum()) == 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows,block_m,group,split_k", [(1, 16, 128, 2), (2, 16, 128, 1), (16, 16, 128, 2), (32, 32, 64, 1), (40, 16, 256, 3), (16, 16, 32, 1)])
@pytest.mark.parametrize("block_n", [32, 64])
def test_mma16_kernel_matches_the_exact_operand(dtype, symmetric, rows, block_m, group, split_k, block_n):
    """`_int4_mma_kernel` builds q - z exactly in x's 16-bit format: the same operand values as
    the fp32-built one, so the same product to the 16-bit output's rounding; K leaves a
    partial last tile for groups under 128 (x masked, padded codes at the zero point); 2 rows
    also take 100 outputs, a partial block of them (the masked loads; the others run unmasked)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (either operand): GPU only")
    k = {32: 416, 64: 448}.get(group, 512)
    n = 100 if rows == 2 else 96
    qw = weight(n, k, group, symmetric)
    packed = int4_layout.pack_for_triton(qw, device, scale_dtype=dtype)
    x = torch.randn(rows, k, device=device).to(dtype)
    bias = torch.randn(n, device=device).to(dtype)
    base = int4_configs.KernelConfig(use_dot=True, block_n=block_n, split_k=split_k, block_m=block_m, magic=False, num_stages=2, mma16=False)
    exact = int4_triton.int4_matmul(x, packed, bias, config=base)
    got = int4_triton.int4_matmul(x, packed, bias, config=int4_configs.KernelConfig(**{**vars(base), "mma16": True}))
    torch.testing.assert_close(got.float(), exact.float(), rtol=1e-2, atol=1e-2)
    reference = int4_layout.reference_matmul(x.float(), packed, bias.float())
    torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2)
    assert int(packed.counters.abs().sum()) == 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma16_kernel_is_exact_up_to_the_largest_zero_point_packed(dtype):
    """Zero points up to 128, the packed range: MAGIC + z stays exact in bf16 (ulp 1 below 256),
    so every product and sum of small integers comes out exact."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (either operand): GPU only")
    torch.manual_seed(0)
    n, k, g = 64, 256, 128
    zeros = torch.randint(100, 129, (n, k // g), dtype=torch.uint8)
    zeros[0, 0] = 128
    qw = QuantizedWeight(codes=torch.randint(0, 16, (n, k), dtype=torch.uint8), scales=torch.full((n, k // g), 2.0**-8),
                         zeros=zeros, group_size=g, bits=4)
    packed = int4_layout.pack_for_triton(qw, device, scale_dtype=dtype)
    x = torch.randint(-2, 3, (16, k), device=device).to(dtype)
    config = int4_configs.KernelConfig(use_dot=True, block_n=32, split_k=1, mma16=True, num_stages=2)
    got = int4_triton.int4_matmul(x, packed, config=config)
    torch.testing.assert_close(got.float(), int4_layout.reference_matmul(x.float(), packed).to(dtype).float(), rtol=0, atol=0)



def test_mma16_all_sends_one_row_through_the_new_kernel(monkeypatch):
    """QFD_INT4_MMA16=all (read at import into MMA16_ONE_ROW): one row takes a 16-row
    `_int4_mma_kernel` block; otherwise the one-row config stays the CUDA-core path."""
    assert not int4_configs.pick_config(1, 4096, 2560).use_dot
    monkeypatch.setattr(int4_configs, "MMA16_ONE_ROW", True)
    cfg = int4_configs.pick_config(1, 4096, 2560)
    assert cfg.use_dot and cfg.mma16 and cfg.block_m == 16
    assert int4_configs.pick_config(16, 4096, 2560).mma16 is None  # 16 rows: QFD_INT4_MMA16 decides

def test_programmatic_dependent_launch_is_off_where_it_cannot_run(monkeypatch):
    """QFD_INT4_PDL asks for it; it is used only on a CUDA tensor of a Hopper-or-later GPU outside
    Triton's interpreter (the interpreter has no griddepcontrol)."""
    monkeypatch.setattr(int4_configs, "PDL_LAUNCH", True)
    cfg = int4_configs.KernelConfig(use_dot=False, block_n=32, split_k=1)
    assert not int4_triton._pdl(cfg, torch.zeros(1))  # a CPU tensor
    monkeypatch.setattr(int4_configs, "PDL_LAUNCH", False)
    assert not int4_triton._pdl(cfg, torch.zeros(1))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] < 9, reason="programmatic dependent launch: Hopper or later")
@pytest.mark.parametrize("rows,use_dot,tiles,split_k", [(1, False, 0, 2), (1, False, 2, 2), (16, True, 0, 2), (32, True, 0, 1)])
def test_a_chain_of_dependent_launches_in_a_cuda_graph_equals_the_reference(rows, use_dot, tiles, split_k):
    """Each product reads the one before it (a square weight, so x -> y -> y' ...): with
    QFD_INT4_PDL's launch a kernel may start before its predecessor ends, and its wait must
    still see that predecessor's output - eagerly and replayed from a CUDA graph."""
    qw = weight(256, 256, 128)
    packed = int4_layout.pack_for_triton(qw, "cuda")
    config = int4_configs.KernelConfig(use_dot=use_dot, block_n=32, split_k=split_k, tiles=tiles, block_m=32 if rows > 16 else 16, pdl=True)
    assert int4_triton._pdl(config, torch.zeros(1, device="cuda"))
    x = torch.randn(rows, 256, device="cuda")

    def chain(h, launch):  # launch after launch, nothing between them (std shrinks ~0.8x a product)
        for _ in range(6):
            h = launch(h)
        return h

    expected = chain(x, lambda h: int4_layout.reference_matmul(h, packed))
    torch.testing.assert_close(chain(x, lambda h: int4_triton.int4_matmul(h, packed, config=config)), expected, rtol=1e-3, atol=1e-3)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = chain(static_x, lambda h: int4_triton.int4_matmul(h, packed, config=config))
    for _ in range(3):
        graph.replay()
        torch.testing.assert_close(static_y, expected, rtol=1e-3, atol=1e-3)
    assert int(packed.counters.abs().sum()) == 0


def test_link_prefetches_chains_the_products_in_the_order_a_step_calls_them():
    """QFD_INT4_PREFETCH's links follow the calls, not the registration order; a module the step
    does not call gets none; the last product prefetches nothing; the output does not change."""
    from qfd.quant.int4_linear import link_prefetches

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.unused = (Int4Linear(weight(128, 128, 128, seed=i), kernel="triton") for i in range(4))

        def forward(self, x):
            return self.b(self.a(self.c(x)))

    net, x = Net(), torch.randn(1, 128)
    before = net(x)
    assert link_prefetches(net, lambda: net(x)) == 2
    assert net.c.prefetch_next is net.a.triton_qweight and net.a.prefetch_next is net.b.triton_qweight
    assert net.b.prefetch_next is None and net.unused.prefetch_next is None
    assert torch.equal(net(x), before)
    assert not net.a._forward_pre_hooks  # the recording hooks are gone


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or not torch.cuda.is_available(), reason="the L2 prefetch is PTX: a GPU only")
@pytest.mark.parametrize("rows,config", [
    (1, int4_configs.KernelConfig(use_dot=False, block_n=32, split_k=2)),
    (1, int4_configs.KernelConfig(use_dot=False, block_n=32, split_k=2, tiles=2, offset_sum=True)),
    (16, int4_configs.KernelConfig(use_dot=True, block_n=64, split_k=2, num_stages=3, mma16=True)),
    (16, int4_configs.KernelConfig(use_dot=True, block_n=64, split_k=1, mma16=False)),
])
def test_a_prefetch_of_the_next_weights_changes_no_result(rows, config):
    packed = int4_layout.pack_for_triton(weight(512, 384, 128), "cuda", scale_dtype=torch.bfloat16)
    following = int4_layout.pack_for_triton(weight(1000, 256, 128, seed=1), "cuda").qweight  # lines past a tile's end included
    x = torch.randn(rows, 384, device="cuda", dtype=torch.bfloat16)
    plain = int4_triton.int4_matmul(x, packed, config=config)
    assert torch.equal(int4_triton.int4_matmul(x, packed, config=config, prefetch=following), plain)
    torch.testing.assert_close(plain.float(), int4_layout.reference_matmul(x.float(), packed), rtol=2e-2, atol=2e-2)


def test_the_tuned_table_keeps_one_entry_per_shape_the_faster(tmp_path):
    """Two linears of one shape (Qwen3.5's attention o_proj and GDN out_proj) both swept: the
    table `bench_int4_kernels.py --write-tuned` writes keeps the faster config once."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_int4_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_int4_kernels", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    slow = vars(int4_configs.KernelConfig(use_dot=False, block_n=64, split_k=8))
    fast = vars(int4_configs.KernelConfig(use_dot=False, block_n=32, split_k=16))
    rows = [{"m": 1, "n": 2560, "k": 4096, "triton_best_us": 8.0, "triton_best_config": slow},
            {"m": 1, "n": 2560, "k": 4096, "triton_best_us": 7.5, "triton_best_config": fast},
            {"m": 16, "n": 2560, "k": 4096, "triton_best_us": 11.0, "triton_best_config": slow}]
    out = tmp_path / "GPU.json"
    bench.write_tuned(str(out), {"device": "GPU", "torch": "x", "weights": "hbm", "rows": rows})
    table = json.loads(out.read_text())["configs"]
    assert [(e["m"], e["us"], e["block_n"]) for e in table] == [(1, 7.5, 32), (16, 11.0, 64)]
    # a later sweep of 16 rows alone replaces that entry and keeps the one-row one
    mma = vars(int4_configs.KernelConfig(use_dot=True, block_n=128, split_k=4, mma16=True))
    bench.write_tuned(str(out), {"device": "GPU", "torch": "x", "weights": "hbm",
                                 "rows": [{"m": 16, "n": 2560, "k": 4096, "triton_best_us": 12.0, "triton_best_config": mma}]})
    table = json.loads(out.read_text())["configs"]
    assert [(e["m"], e["us"], e["block_n"], e["mma16"]) for e in table] == [(1, 7.5, 32, None), (16, 12.0, 128, True)]


def gated_pair_packed(k, half, group, symmetric, device, dtype):
    """A gate and an up projection's packed layouts, interleaved column by column for a GATED
    product, and their concatenation [gate | up] for the plain product to compare with."""
    gate, up = (int4_layout.pack_for_triton(weight(half, k, group, symmetric, seed), device, scale_dtype=dtype) for seed in (1, 2))
    zeros = None if symmetric else (gate.zeros, up.zeros)

    def joined(join):
        return int4_layout.TritonInt4Weight(join(gate.qweight, up.qweight), join(gate.scales, up.scales), None if zeros is None else join(*zeros),
                                            torch.zeros_like(gate.counters), group, k, 2 * half)

    return joined(int4_layout.interleave_columns), joined(lambda a, b: torch.cat([a, b], dim=-1))


@needs_triton
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows,dtype,config", [
    (1, torch.float32, dict(use_dot=False, block_n=32, split_k=2, tiles=2)),  # `_int4_gemv_kernel`
    (1, torch.bfloat16, dict(use_dot=False, block_n=32, split_k=2, tiles=1, two_slot=True)),  # `_int4_gemv_two_slot_kernel`
    (1, torch.float32, dict(use_dot=False, block_n=32, split_k=1)),  # `_int4_mm_kernel`, CUDA cores
    (3, torch.float32, dict(use_dot=True, block_n=32, split_k=2, mma16=False)),
    (16, torch.float32, dict(use_dot=True, block_n=64, split_k=1, mma16=False, w_first=True)),
    (16, torch.float16, dict(use_dot=True, block_n=32, split_k=2, num_stages=2)),  # `_int4_mma_kernel`
    (32, torch.float16, dict(use_dot=True, block_n=64, split_k=1, block_m=32, num_stages=2)),
])
def test_a_gated_product_stores_silu_of_gate_times_up(symmetric, rows, dtype, config):
    """GATED: gate and up interleaved column by column, the kernel stores silu(gate) * up [rows,
    N / 2] (50 outputs: a partial last block) - the plain product of the same weights, then the
    MLP's activation in torch, to its 16-bit rounding - and leaves its split-K counters at zero."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, half = 512, 50
    interleaved, side_by_side = gated_pair_packed(k, half, 128, symmetric, device, dtype)
    torch.manual_seed(3)
    x = torch.randn(rows, k, device=device).to(dtype)
    bias = torch.randn(2 * half, device=device).to(dtype)
    cfg = int4_configs.KernelConfig(**config)
    got = int4_triton.int4_matmul(x, interleaved, int4_layout.interleave_columns(bias[:half], bias[half:]), config=cfg, gated=True)
    assert got.shape == (rows, half) and got.dtype == dtype
    plain = int4_triton.int4_matmul(x, side_by_side, bias, config=cfg)
    expected = int4_layout.silu_mul_interleaved(int4_layout.interleave_columns(plain[:, :half], plain[:, half:]))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    gate, up = plain[:, :half].float(), plain[:, half:].float()
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(gate) * up, rtol=1e-2, atol=1e-2)
    assert int(interleaved.counters.abs().sum()) == 0


def test_a_gated_products_reference_and_fake_give_half_the_outputs():
    """Without the kernel (Triton missing, or CPU tensors outside the interpreter) the op's
    reference computes the same gated result; torch.compile's fake kernel has its shape."""
    interleaved, side_by_side = gated_pair_packed(256, 24, 128, False, "cpu", torch.float32)
    x = torch.randn(2, 256)
    got = int4_layout.reference_matmul(x, interleaved, gated=True)
    plain = int4_layout.reference_matmul(x, side_by_side)
    torch.testing.assert_close(got, torch.nn.functional.silu(plain[:, :24]) * plain[:, 24:], rtol=1e-5, atol=1e-5)
    fake = int4_triton._int4_mm_fake(x, interleaved.qweight, interleaved.scales, interleaved.zeros, interleaved.counters, None, 128, 256, gated=True)
    assert fake.shape == (2, 24)
    with pytest.raises(ValueError, match="even number of outputs"):
        odd = int4_layout.pack_for_triton(weight(5, 256), "cpu")
        int4_triton.int4_matmul(x, odd, gated=True)
