"""qfd's one-launch RMSNorm (qfd.kernels.norm_triton) and the modules that use it.

Kernel tests run where Triton does (a GPU, or TRITON_INTERPRET=1 on a CPU); the reference's
agreement with the modules' torch forms and the dispatch rule run on CI."""

from __future__ import annotations

import pytest
import torch

import qfd.kernels
from qfd.kernels import graphed_step, interpreting, norm_triton
from qfd.models import drafter, gdn, target
from tests.test_int4_triton import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = {"plain": norm_triton.PLAIN, "zero_centered": norm_triton.ZERO_CENTERED, "gated": norm_triton.GATED}


def _inputs(shape, dtype, device=DEVICE, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(*shape, device=device) * 3
    w = torch.randn(shape[-1], device=device).to(dtype) * 0.5 + 1
    return x.to(dtype), w


def _close(got, want):
    """float32: to 1e-5; bf16: a few roundings apart - the reduction order differs, Triton's CPU
    interpreter rounds float32 -> bf16 toward zero where the GPU rounds to nearest even, and the
    gated form rounds three times (h, w * h, the result), each up to one bf16 step (2^-8)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = dict(rtol=1e-5, atol=1e-5) if want.dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@needs_triton
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2560), (1, 5, 4, 96), (2, 16, 8, 128)])
def test_the_kernel_matches_the_reference(mode, dtype, shape):
    x, w = _inputs(shape, dtype)
    gate = torch.randn(shape, device=DEVICE).to(dtype) if mode == "gated" else None
    _close(norm_triton.rms_norm(x, w, 1e-6, MODES[mode], gate), norm_triton.reference(x, w, 1e-6, MODES[mode], gate))


@needs_triton
def test_a_strided_gate_and_a_float32_input_to_a_bf16_gated_norm():
    """The GDN's case: z is a slice of the fused projection's output ([B, T, H, dv] with the row
    stride of the whole projection) and the core output arrives in float32: no copies, and x is
    rounded to bf16 before the norm as the torch form does."""
    B, T, H, dv = 1, 16, 8, 128
    proj = torch.randn(B, T, 3 * H * dv, device=DEVICE).to(torch.bfloat16)
    z = proj[..., H * dv: 2 * H * dv].reshape(B, T, H, dv)
    assert not z.is_contiguous()
    core = torch.randn(B, T, H, dv, device=DEVICE) * 2
    w = (torch.randn(dv, device=DEVICE) * 0.5 + 1).to(torch.bfloat16)
    got = norm_triton.rms_norm(core, w, 1e-6, norm_triton.GATED, z)
    assert got.dtype == torch.bfloat16
    _close(got, norm_triton.reference(core, w, 1e-6, norm_triton.GATED, z))


@needs_triton
@pytest.mark.parametrize("mode", ["plain", "zero_centered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_add_and_norm_kernel_matches_the_add_then_the_norm(mode, dtype):
    h, w = _inputs((1, 5, 2560), dtype)
    x = torch.randn(1, 5, 2560, device=DEVICE).to(dtype)
    total, normed = norm_triton.add_rms_norm(h, x, w, 1e-6, MODES[mode])
    assert torch.equal(total, h + x) or interpreting()  # (the interpreter rounds bf16 toward zero)
    _close(total, h + x)
    _close(normed, norm_triton.reference(h + x, w, 1e-6, MODES[mode]))


def test_add_and_norm_refuses_mismatched_inputs_and_the_gated_norm():
    h, w = _inputs((2, 64), torch.float32, device="cpu")
    with pytest.raises(ValueError, match="add_rms_norm"):
        norm_triton.add_rms_norm(h, h.to(torch.bfloat16), w, 1e-6)
    with pytest.raises(ValueError, match="add_rms_norm"):
        norm_triton.add_rms_norm(h, h, w, 1e-6, norm_triton.GATED)


def test_a_layers_add_and_norm_is_the_add_then_the_norm():
    """The torch form (CPU, or QFD_FUSED_ADD_NORM=0): exactly what the layer computed before."""
    h, w = _inputs((1, 3, 64), torch.bfloat16, device="cpu")
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    norm = target.RMSNorm(64, 1e-6, zero_centered=True).to(torch.bfloat16)
    total, normed = norm.add_and_norm(h, x)
    assert torch.equal(total, h + x) and torch.equal(normed, _spec(h + x, norm.weight, 1e-6, "zero_centered"))


def test_a_gated_norm_without_a_matching_gate_is_refused():
    x, w = _inputs((4, 64), torch.float32, device="cpu")
    with pytest.raises(ValueError, match="GATED needs a gate"):
        norm_triton.rms_norm(x, w, 1e-6, norm_triton.GATED, torch.randn(4, 32))


def _spec(x, w, eps, kind, gate=None):
    """The norms as transformers writes them (Llama/Qwen3 RMSNorm, Qwen3.5's zero-centered one,
    Qwen3_5RMSNormGated), independent of qfd's code."""
    dtype = gate.dtype if kind == "gated" else x.dtype
    h = x.to(dtype).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "zero_centered":
        return (h * (1.0 + w.float())).to(dtype)
    h = w * h.to(dtype)
    return (h * torch.nn.functional.silu(gate.float())).to(dtype) if kind == "gated" else h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_modules_torch_form_is_transformers_math(dtype):
    """Bit for bit on the CPU: the modules' torch form (`norm_triton.reference`, which the kernel
    is checked against) is each model's own norm."""
    x, w = _inputs((2, 7, 64), dtype, device="cpu")
    gate = torch.randn(2, 7, 64).to(dtype)
    for module, kind in ((target.RMSNorm(64, 1e-6), "plain"), (target.RMSNorm(64, 1e-6, zero_centered=True), "zero_centered"),
                         (drafter.RMSNorm(64, 1e-6), "plain")):
        module = module.to(dtype)
        with torch.no_grad():
            module.weight.copy_(w)
        assert torch.equal(module(x), _spec(x, module.weight, 1e-6, kind))
        assert torch.equal(norm_triton.reference(x, module.weight, 1e-6, MODES[kind]), _spec(x, module.weight, 1e-6, kind))
    gated = gdn.GatedRMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        gated.weight.copy_(w)
    core = x.float() * 1.5  # float32, as the GDN kernels return it
    assert torch.equal(gated(core, gate), _spec(core, gated.weight, 1e-6, "gated", gate))


def test_modules_use_the_kernel_only_in_a_graphed_gpu_step_outside_compile(monkeypatch):
    x, w = _inputs((2, 64), torch.bfloat16, device="cpu")
    with graphed_step():
        assert not norm_triton.use_kernel(x, w, x.dtype)  # a CPU tensor: torch's form
    if not torch.cuda.is_available():
        return
    xc, wc = x.cuda(), w.cuda()
    assert not norm_triton.use_kernel(xc, wc, xc.dtype)  # eager: torch's form
    monkeypatch.setenv("QFD_FUSED_NORM", "all")
    assert norm_triton.use_kernel(xc, wc, xc.dtype) == norm_triton.HAVE_TRITON  # ... unless asked for the A/B
    monkeypatch.delenv("QFD_FUSED_NORM")
    monkeypatch.setattr(qfd.kernels, "_graphed_depth", 1)
    assert norm_triton.use_kernel(xc, wc, xc.dtype) == norm_triton.HAVE_TRITON
    assert not norm_triton.use_kernel(xc, wc.float(), xc.dtype)  # torch would promote to float32
    monkeypatch.setenv("QFD_FUSED_NORM", "0")
    assert not norm_triton.use_kernel(xc, wc, xc.dtype)
    monkeypatch.delenv("QFD_FUSED_NORM")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not norm_triton.use_kernel(xc, wc, xc.dtype)  # inductor fuses torch's form with its neighbours


def test_the_graphed_step_context_nests_and_unwinds():
    assert not qfd.kernels.in_graphed_step()
    with pytest.raises(RuntimeError):
        with graphed_step(), graphed_step():
            assert qfd.kernels._graphed_depth == 2
            raise RuntimeError
    assert not qfd.kernels.in_graphed_step()


@pytest.mark.skipif(not (torch.cuda.is_available() and norm_triton.HAVE_TRITON), reason="the modules dispatch to the kernel in graphed CUDA steps only")
def test_a_graphed_gpu_step_gives_the_modules_torch_results():
    from qfd.models.graphs import capture

    x, w = _inputs((1, 16, 2560), torch.bfloat16)
    module = target.RMSNorm(2560, 1e-6, zero_centered=True).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
        eager = module(x)  # torch's form
        graph, graphed = capture(lambda: module(x))  # the kernel, warmed up and captured
        graph.replay()
        torch.cuda.synchronize()
    _close(graphed, eager)
