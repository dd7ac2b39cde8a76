"""Grid math: fake-quant on the grid equals dequantization, clipped STE, GPTQ beats RTN."""

from __future__ import annotations

import pytest
import torch

from qfd.quant.calibrate import gptq_quantize
from qfd.quant.grid import dequantize, fake_quant, requantize, round_to_grid, rtn_quantize


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_rtn_codes_in_range_and_grid_roundtrip(symmetric, group_size):
    qw = rtn_quantize(torch.randn(24, 256), group_size, symmetric=symmetric)
    lo, hi = (-8, 7) if symmetric else (0, 15)
    assert int(qw.codes.min()) >= lo and int(qw.codes.max()) <= hi
    assert qw.scales.shape == (24, 256 // group_size)
    # the dequantized weight sits exactly on the grid: rounding it gives the same codes
    assert torch.equal(round_to_grid(dequantize(qw), qw.scales, qw.zeros, group_size).to(torch.int16), qw.codes.to(torch.int16))
    again = requantize(qw, dequantize(qw))
    assert again.scales is qw.scales and again.zeros is qw.zeros


@pytest.mark.parametrize("symmetric", [True, False])
def test_fake_quant_of_dequantized_weight_is_identity(symmetric):
    qw = rtn_quantize(torch.randn(16, 64), 32, symmetric=symmetric, scale_dtype=torch.bfloat16)
    w = dequantize(qw)
    assert torch.equal(fake_quant(w, qw.scales.float(), None if qw.zeros is None else qw.zeros.float(), 32), w)


def test_fake_quant_rounds_and_clips():
    scales = torch.full((1, 1), 0.5)
    w = torch.tensor([[0.26, -0.74, 100.0, -100.0] + [0.0] * 28])
    out = fake_quant(w, scales, None, 32)
    assert out[0, :4].tolist() == [0.5, -0.5, 3.5, -4.0]  # codes 1, -1, 7 (clamped), -8 (clamped)


def test_clipped_ste_zeroes_gradient_outside_the_range():
    scales = torch.full((1, 1), 1.0)
    w = torch.tensor([[0.3, 7.4, 7.6, -8.4, -8.6, 3.0] + [0.0] * 26], requires_grad=True)
    fake_quant(w, scales, None, 32).sum().backward()
    assert w.grad[0, :6].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    zeros = torch.full((1, 1), 8.0)  # zero-point grid 0..15: representable w in [-8.5, 7.5]
    w2 = torch.tensor([[-8.4, -8.6, 7.4, 7.6] + [0.0] * 28], requires_grad=True)
    fake_quant(w2, scales, zeros, 32).sum().backward()
    assert w2.grad[0, :4].tolist() == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_has_lower_output_error_than_rtn(symmetric):
    torch.manual_seed(0)
    mix = torch.randn(128, 128)
    x = torch.randn(2048, 128) @ mix  # correlated inputs: where GPTQ's error feedback pays off
    w = torch.randn(64, 128)
    hessian = 2 * x.t() @ x / x.shape[0]
    gptq = gptq_quantize(w, hessian, 32, symmetric=symmetric)
    rtn = rtn_quantize(w, 32, symmetric=symmetric)
    err = lambda qw: ((x @ (dequantize(qw) - w).t()) ** 2).mean()  # noqa: E731
    assert err(gptq) < 0.8 * err(rtn)
    lo, hi = (-8, 7) if symmetric else (0, 15)
    assert int(gptq.codes.min()) >= lo and int(gptq.codes.max()) <= hi
