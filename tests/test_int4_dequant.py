"""qfd's INT4 dequant kernel (qfd.kernels.int4_dequant) and Int4Linear's long-prompt path.

The kernel must reproduce `int4_layout.dequantize_packed` bit for bit (transposed): float32
(u - z) * s, then one rounding to the output dtype. Kernel tests run where Triton does (a GPU,
or TRITON_INTERPRET=1 on a CPU); the op's torch fallback and Int4Linear's wiring run on CI."""

from __future__ import annotations

import pytest
import torch

from qfd.kernels import int4_dequant, int4_layout, interpreting
from qfd.quant.grid import dequantize, rtn_quantize
from qfd.quant.int4_linear import KERNEL_MAX_ROWS, Int4Linear
from tests.test_int4_triton import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (N, K, group): N off a multiple of the block, K padded by the layout (320 / 64 -> 384,
# 96 / 32 -> 128), groups spanning one tile or several (256)
SHAPES = [(40, 256, 128), (24, 320, 64), (16, 96, 32), (72, 512, 256), (33, 768, 256), (200, 384, 128)]


def packed_weight(n, k, group, symmetric, scale_dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    qw = rtn_quantize(torch.randn(n, k) * 0.05, group, symmetric=symmetric, scale_dtype=scale_dtype)
    return int4_layout.pack_for_triton(qw, device)


def op_args(packed):
    return packed.qweight, packed.scales, packed.zeros, packed.group_size, packed.in_features


def reference_t(packed, dtype):
    """The float32 torch reference, transposed to [K, N], rounded once to `dtype`."""
    return int4_layout.dequantize_packed(packed, torch.float32).t().to(dtype)


def assert_matches_reference(got, packed, dtype):
    """Bit-exact against `reference_t`. Triton's CPU interpreter (3.9) rounds float32 -> bf16 toward
    zero (`cast_impl` in triton/runtime/interpreter.py) where the GPU rounds to nearest even, as
    torch does: under the interpreter a bf16 result may instead equal the truncated reference."""
    assert got.shape == (packed.in_features, packed.out_features) and got.dtype == dtype and got.is_contiguous()
    if torch.equal(got, reference_t(packed, dtype)):
        return
    assert interpreting() and dtype == torch.bfloat16, "differs from the reference"
    f32 = reference_t(packed, torch.float32).contiguous()
    truncated = (f32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    assert torch.equal(got, truncated), "differs from the reference, truncated or rounded"


@needs_triton
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_is_bit_exact_against_the_reference(n, k, group, symmetric, dtype):
    packed = packed_weight(n, k, group, symmetric, device=DEVICE)
    got = int4_dequant.dequantize_to(*op_args(packed), dtype, block_n=32)  # several N blocks, the last partial
    assert_matches_reference(got, packed, dtype)


@needs_triton
@pytest.mark.parametrize("symmetric", [True, False])
def test_kernel_default_block_and_bf16_scales(symmetric):
    packed = packed_weight(200, 384, 64, symmetric, scale_dtype=torch.bfloat16, device=DEVICE)  # 200: one full block of 128, one partial
    got = int4_dequant.dequantize_to(*op_args(packed), torch.bfloat16)
    assert_matches_reference(got, packed, torch.bfloat16)


@needs_triton
def test_the_op_runs_the_kernel_where_triton_runs(monkeypatch):
    packed = packed_weight(24, 320, 64, False, device=DEVICE)
    calls = []
    kernel = int4_dequant.dequantize_to
    monkeypatch.setattr(int4_dequant, "dequantize_to", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    got = int4_dequant.int4_dequant_op(*op_args(packed), torch.bfloat16)
    assert calls
    assert_matches_reference(got, packed, torch.bfloat16)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group", SHAPES[:3])
def test_the_op_falls_back_to_torch_where_no_kernel_runs(monkeypatch, n, k, group, symmetric):
    monkeypatch.setattr(int4_dequant, "runs_on", lambda x: False)  # as on CI, or a CPU tensor without the interpreter
    monkeypatch.setattr(int4_dequant, "dequantize_to", None)  # the fallback must not reach for the kernel
    packed = packed_weight(n, k, group, symmetric)
    for dtype in (torch.float32, torch.bfloat16):
        got = int4_dequant.int4_dequant_op(*op_args(packed), dtype)
        assert got.shape == (k, n) and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, reference_t(packed, dtype))


def test_the_op_compiles_with_its_fake_kernel():
    packed = packed_weight(24, 320, 64, True)
    compiled = torch.compile(lambda *a: int4_dequant.int4_dequant_op(*a, torch.bfloat16), fullgraph=True, backend="aot_eager")
    got = compiled(*op_args(packed))
    assert_matches_reference(got, packed, torch.bfloat16)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group,bias", [(64, 256, 128, False), (40, 320, 64, True), (24, 96, 32, True)])
def test_int4linear_triton_long_prompts_run_the_dequant_op(monkeypatch, n, k, group, bias, symmetric):
    """More than KERNEL_MAX_ROWS["triton"] rows: x @ w_t with w_t from the op, the dense layer's
    result (test_int4_triton.py checks the short-prompt rows). On CPU without the interpreter
    the op runs its fallback, with the interpreter (or on a GPU) the kernel."""
    torch.manual_seed(1)
    qw = rtn_quantize(torch.randn(n, k) * 0.05, group, symmetric=symmetric, scale_dtype=torch.float32)
    if bias:
        qw = type(qw)(qw.codes, qw.scales, qw.zeros, qw.group_size, qw.bits, torch.randn(n))
    layer = Int4Linear(qw, device=DEVICE, kernel="triton")
    assert layer.mode == "triton"
    calls = []
    op = int4_dequant.int4_dequant_op
    monkeypatch.setattr(int4_dequant, "int4_dequant_op", lambda *a: calls.append(a[-1]) or op(*a))
    rows = KERNEL_MAX_ROWS["triton"] + 44
    x = torch.randn(2, rows // 2, k, device=DEVICE)
    expected = torch.nn.functional.linear(x, dequantize(qw, torch.float32).to(DEVICE), None if qw.bias is None else qw.bias.to(DEVICE))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert calls == [torch.float32]
    # dequantized_weight() ([out, in], every mode's contract) goes through the same op
    assert torch.equal(layer.dequantized_weight(torch.float32), dequantize(qw, torch.float32).to(DEVICE))


def test_int4linear_triton_long_prompts_in_bf16():
    torch.manual_seed(2)
    qw = rtn_quantize(torch.randn(48, 256) * 0.05, 128, scale_dtype=torch.bfloat16)
    layer = Int4Linear(qw, device=DEVICE, dtype=torch.bfloat16, kernel="triton")
    assert layer.mode == "triton"
    x = torch.randn(KERNEL_MAX_ROWS["triton"] + 1, 256, device=DEVICE, dtype=torch.bfloat16)
    expected = x.float() @ dequantize(qw, torch.float32).to(DEVICE).t()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)
