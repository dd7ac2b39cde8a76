"""GPTQ driver (qfd.quant.gptq): same grid as RTN, never worse than RTN, hooks, sequential."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qfd.errors import QfdError
from qfd.quant.grid import dequantize, rtn_quantize
from qfd.quant.gptq import (
    GPTQConfig,
    HessianCollector,
    gptq_quantize_module,
    gptq_quantize_weight,
    gptqmodel_quantize_weight,
    groups_by_block,
    layer_error,
    weighted_error,
)

REF = GPTQConfig(backend="reference")


def correlated_inputs(n: int, features: int, seed: int) -> torch.Tensor:
    """Inputs with strongly correlated features (a random mixing) plus a few outlier channels,
    the regime where GPTQ's error feedback helps most."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) / features**0.5
    x = torch.randn(n, features, generator=g) @ mix + 0.05 * torch.randn(n, features, generator=g)
    x[:, :4] *= 5.0
    return x


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    return 2.0 * x.T @ x / x.shape[0]


def test_identity_hessian_gives_exactly_rtn():
    # With H = I the error of a column feeds back into no other column: GPTQ is RTN, so the
    # two share the grid (code range, scale rule and stored scale dtype) bit for bit.
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    q = gptq_quantize_weight(w, torch.eye(256), REF)
    r = rtn_quantize(w, 128)
    assert torch.equal(q.codes, r.codes)
    assert torch.equal(q.scales, r.scales)


@pytest.mark.parametrize("shape,group,seed", [((64, 256), 128, 0), ((96, 384), 128, 1), ((40, 256), 32, 2), ((128, 128), 64, 3)])
def test_gptq_not_worse_than_rtn_on_correlated_inputs(shape, group, seed):
    torch.manual_seed(seed)
    out_f, in_f = shape
    w = torch.randn(out_f, in_f) * 0.05
    x = correlated_inputs(4 * in_f, in_f, seed)
    h = hessian_of(x)
    cfg = GPTQConfig(backend="reference", group_size=group)
    q = gptq_quantize_weight(w, h, cfg)
    assert q.codes.dtype == torch.int8 and q.codes.shape == (out_f, in_f)
    assert int(q.codes.min()) >= -8 and int(q.codes.max()) <= 7
    assert q.scales.shape == (out_f, in_f // group) and q.scales.dtype == torch.float16
    assert q.zeros is None and q.group_size == group
    err = layer_error("w", w, q, h, x.shape[0], cfg, cfg.damp)
    assert err.hessian_gptq <= err.hessian_rtn
    assert err.ratio < 0.9  # correlated inputs: a real gain, not a tie
    # the plain output MSE on the calibration inputs agrees with the Hessian form
    mse = ((x @ (w - dequantize(q)).T) ** 2).mean().item()
    assert err.mse_gptq == pytest.approx(mse, rel=1e-3)


def test_gptqmodel_backend_matches_reference_bit_for_bit():
    # gptqmodel's per-layer GPTQ with qfd's quantizer: identical codes and scales.
    torch.manual_seed(4)
    w = torch.randn(64, 256) * 0.02
    x = correlated_inputs(1024, 256, 4)
    h = hessian_of(x)
    ref = gptq_quantize_weight(w, h, REF)
    gm, damp = gptqmodel_quantize_weight(w, h, x.shape[0], GPTQConfig(backend="gptqmodel"))
    assert damp == pytest.approx(0.01)
    assert torch.equal(ref.scales, gm.scales)
    assert (ref.codes == gm.codes).float().mean().item() > 0.999


def test_dead_inputs_do_not_break_the_cholesky():
    torch.manual_seed(5)
    w = torch.randn(32, 128)
    x = correlated_inputs(512, 128, 5)
    x[:, 7] = 0.0  # a feature that never fires
    q = gptq_quantize_weight(w, hessian_of(x), REF)
    assert torch.isfinite(q.scales.float()).all()
    assert int(q.codes[:, 7].abs().max()) == 0


def test_config_errors_are_user_errors():
    with pytest.raises(QfdError, match="multiple of group size"):
        gptq_quantize_weight(torch.randn(8, 100), torch.eye(100), REF)
    with pytest.raises(QfdError, match="block size"):
        gptq_quantize_weight(torch.randn(8, 256), torch.eye(256), GPTQConfig(backend="reference", block_size=96))
    with pytest.raises(QfdError, match="backend"):
        gptq_quantize_module(nn.Linear(128, 8), lambda: None, GPTQConfig(backend="nope"))


class TwoCalls(nn.Module):
    """A linear applied to two different inputs per forward (like the drafter's k/v
    projections over context features and block states), then a second layer."""

    def __init__(self):
        super().__init__()
        self.kv = nn.Linear(128, 128)
        self.layers = nn.ModuleList([nn.Linear(128, 128, bias=False)])

    def forward(self, a, b):
        h = torch.cat([torch.relu(self.kv(a)).flatten(0, 1), torch.relu(self.kv(b)).flatten(0, 1)])
        return self.layers[0](h)


def test_hessian_collector_accumulates_every_call():
    torch.manual_seed(6)
    model = TwoCalls()
    a, b = torch.randn(3, 10, 128), torch.randn(2, 7, 128)
    with HessianCollector(model, ["kv"]) as hc:
        model(a, b)
    h, n = hc.hessian("kv")
    x = torch.cat([a.reshape(-1, 128), b.reshape(-1, 128)])
    assert n == 30 + 14
    torch.testing.assert_close(h, hessian_of(x), rtol=1e-5, atol=1e-5)
    # hooks are removed on exit
    model(a, b)
    assert hc.tokens["kv"] == 44
    with pytest.raises(QfdError, match="not an nn.Linear"):
        HessianCollector(model, ["layers"])


def test_module_driver_sequential_and_restores_weights():
    torch.manual_seed(7)
    model = TwoCalls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a, b = correlated_inputs(256, 128, 7).reshape(8, 32, 128), correlated_inputs(128, 128, 8).reshape(4, 32, 128)
    calls = []

    def calibrate():
        calls.append(1)
        model(a, b)

    groups = groups_by_block(["layers.0", "kv"], first=("kv",))
    assert groups == [["kv"], ["layers.0"]]
    result = gptq_quantize_module(model, calibrate, REF, groups=groups)
    assert len(calls) == 2  # one calibration pass per sequential group
    assert set(result.qweights) == {"kv", "layers.0"}
    assert torch.equal(result.qweights["kv"].bias, before["kv.bias"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} was modified"
    for err in result.errors.values():
        assert err.hessian_gptq <= err.hessian_rtn
    # the second group was calibrated on the QUANTIZED first layer's outputs
    with torch.no_grad():
        model.kv.weight.copy_(dequantize(result.qweights["kv"]))
        with HessianCollector(model, ["layers.0"]) as hc:
            model(a, b)
        model.kv.weight.copy_(before["kv.weight"])
    h_seq, _ = hc.hessian("layers.0")
    q_again = gptq_quantize_weight(before["layers.0.weight"], h_seq, REF)
    assert torch.equal(q_again.codes, result.qweights["layers.0"].codes)


def test_weighted_error_is_trace_form():
    torch.manual_seed(9)
    w, q, h = torch.randn(5, 16), torch.randn(5, 16), hessian_of(torch.randn(40, 16))
    assert weighted_error(w, q, h) == pytest.approx(torch.trace((w - q) @ h @ (w - q).T).item(), rel=1e-6)
