"""An attention step's inputs in one launch (qfd.kernels.attention_inputs_triton): the torch form's
queries and cache writes; and a whole model's graphed-step launch cuts against its torch form.

Kernel tests run where Triton does (a GPU, or TRITON_INTERPRET=1 on a CPU); the dispatch rule
runs on CI; the model test needs a GPU (the modules use the kernels in graphed CUDA steps only)."""

from __future__ import annotations

import pytest
import torch

import qfd.kernels
from qfd.kernels import attention_inputs_triton as inputs_triton
from qfd.models import rope, target
from tests.test_int4_triton import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, T, H, kvh, hd, rotary, norm, dtype, slots, seed=0):
    """q/k/v as the fused projection hands them over (views of one [B, T, ...] output, the query
    heads interleaved with their output gates as Qwen3.5's are), the layer's norms, cos / sin,
    caches of 12 slots with something in them already."""
    torch.manual_seed(seed)
    packed = (torch.randn(B, T, H * 2 * hd + 2 * kvh * hd, device=DEVICE) * 2).to(dtype)
    q = packed[..., : H * 2 * hd].view(B, T, H, 2 * hd)[..., :hd]
    k = packed[..., H * 2 * hd : H * 2 * hd + kvh * hd].view(B, T, kvh, hd)
    v = packed[..., H * 2 * hd + kvh * hd :].view(B, T, kvh, hd)
    norms = (None, None)
    if norm is not None:
        norms = tuple(target.RMSNorm(hd, 1e-6, zero_centered=norm == "zero_centered").to(DEVICE, dtype) for _ in range(2))
        for module in norms:
            module.weight.data.copy_(torch.randn(hd) * 0.3 + (0 if norm == "zero_centered" else 1))
    inv = 1.0 / (10000 ** (torch.arange(0, rotary, 2, device=DEVICE).float() / rotary))
    cos, sin = rope.cos_sin(inv, torch.arange(7, 7 + T, device=DEVICE), dtype)
    caches = [torch.randn(B, kvh, 12, hd, device=DEVICE).to(dtype) for _ in range(2)]
    return q, k, v, norms, cos, sin, caches, torch.tensor(slots, device=DEVICE)


def _assert_close(got, want):
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # a few bf16 roundings apart (reduction order; the interpreter rounds toward zero)
        torch.testing.assert_close(got.float(), want.float(), rtol=4e-2, atol=4e-2)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [None, "plain", "zero_centered"])
@pytest.mark.parametrize("B,T,H,kvh,hd,rotary,slots", [
    (1, 1, 8, 2, 256, 64, [9]),  # a decode, Qwen3.5-4B's partial rotary
    (1, 4, 4, 2, 64, 64, [3, 4, 5, 6]),  # a verify block, the whole head rotated
    (2, 3, 6, 3, 96, 32, [10, 2, 7]),  # a tree's slots in any order, two sequences
])
def test_the_kernel_matches_the_torch_form(B, T, H, kvh, hd, rotary, slots, norm, dtype):
    q, k, v, (q_norm, k_norm), cos, sin, caches, slots = _case(B, T, H, kvh, hd, rotary, norm, dtype, slots)
    want_caches = [c.clone() for c in caches]
    want = inputs_triton.reference(q, k, v, q_norm, k_norm, cos, sin, *want_caches, slots)
    got = inputs_triton.prepare(q, k, v, q_norm, k_norm, cos, sin, *caches, slots)
    assert got.shape == (B, H, T, hd) and got.is_contiguous() and got.dtype == dtype
    _assert_close(got, want)
    for got_cache, want_cache in zip(caches, want_caches):
        _assert_close(got_cache, want_cache)
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert torch.equal(caches[0][:, :, untouched], want_caches[0][:, :, untouched])


def test_the_reference_is_the_attention_layers_own_torch_form():
    """What the kernel is checked against is what the layer computes without it."""
    q, k, v, (q_norm, k_norm), cos, sin, caches, slots = (
        (t.cpu() if isinstance(t, torch.Tensor) else t) for t in _case(1, 3, 4, 2, 64, 32, "zero_centered", torch.float32, [0, 1, 2]))
    q_norm, k_norm = q_norm.cpu(), k_norm.cpu()
    caches = [c.cpu() for c in caches]
    got = inputs_triton.reference(q, k, v, q_norm, k_norm, cos, sin, *caches, slots.cpu())
    want = rope.apply_rope(q_norm(q).transpose(1, 2), cos, sin)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(caches[0][:, :, :3], rope.apply_rope(k_norm(k).transpose(1, 2), cos, sin))
    torch.testing.assert_close(caches[1][:, :, :3], v.transpose(1, 2))


def test_the_kernel_runs_only_in_a_graphed_gpu_step_unless_switched_off(monkeypatch):
    q = torch.zeros(1, 1, 2, 64)
    cos = torch.zeros(1, 32)
    monkeypatch.delenv("QFD_FUSED_QKV", raising=False)  # on by default
    with qfd.kernels.graphed_step():
        assert not inputs_triton.use_kernel(q, cos, q)  # CPU tensors: torch's form
    if not torch.cuda.is_available():
        return
    qc, cc = q.cuda(), cos.cuda()
    assert not inputs_triton.use_kernel(qc, cc, qc)  # eager
    with qfd.kernels.graphed_step():
        assert inputs_triton.use_kernel(qc, cc, qc) == qfd.kernels.HAVE_TRITON
        assert not inputs_triton.use_kernel(qc, cc.half(), qc)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not inputs_triton.use_kernel(qc, cc, qc)
    monkeypatch.undo()
    monkeypatch.setenv("QFD_FUSED_QKV", "0")
    with qfd.kernels.graphed_step():
        assert not inputs_triton.use_kernel(qc, cc, qc)  # switched off


@pytest.mark.skipif(not (torch.cuda.is_available() and qfd.kernels.HAVE_TRITON), reason="the modules use the kernels in graphed CUDA steps only")
@pytest.mark.parametrize("knobs", [{"QFD_FUSED_QKV": "1"}, {"QFD_FUSED_ADD_NORM": "1"}, {"QFD_FUSED_QKV": "1", "QFD_FUSED_ADD_NORM": "1"}])
def test_a_graphed_step_with_the_launch_cuts_gives_the_torch_forms_results(monkeypatch, tmp_path, knobs):
    """A tiny Qwen3.5 (attention + Gated DeltaNet layers) in bf16: a 4-token verify with taps,
    as graphed steps run it (`graphed_step`, the kernels) and in torch's form."""
    from qfd.models.loading import load_target
    from tests.tiny import make_tiny_checkpoint

    model, _ = load_target(make_tiny_checkpoint("qwen3_5", tmp_path / "t"), device="cuda", dtype=torch.bfloat16, tokenizer=False)
    prompt = torch.randint(0, 512, (1, 20), device="cuda")
    block = torch.randint(0, 512, (1, 4), device="cuda")
    results = []
    for use_knobs in (False, True):
        for name, value in knobs.items():
            monkeypatch.setenv(name, value if use_knobs else "0")
        cache = model.new_cache(64, static=True)
        with torch.inference_mode():
            model(prompt, cache)
            if use_knobs:
                with qfd.kernels.graphed_step():
                    out = model(block, cache, tap_layers=(0, 2, 3))
            else:
                out = model(block, cache, tap_layers=(0, 2, 3))
        results.append((out.logits.float(), out.taps.float(), cache.kv.float()))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    assert not qfd.kernels.kernel_failures()
