"""A prompt's Gated DeltaNet through flash-linear-attention's conv + chunk rule
(`qfd.kernels.gdn_fla.prompt_conv_and_rule`, `GatedDeltaNet._prompt_fla`).

The package runs on a GPU only. On a CPU its two entry points are replaced by float32 torch
references of what they compute (documented behaviour: a causal depthwise conv whose output
row t sees rows t-K+1..t, SiLU; the gated delta rule with in-kernel q/k L2 normalisation and
value head h reading key head h // (HV / H)): that checks qfd's plumbing - the conv history
rows, the recorded window and state, a rollback inside the prompt - against qfd's own path.
On a GPU with the package installed, the real kernels are checked against qfd's path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qfd.kernels import gdn_fla
from qfd.models.gdn import l2norm, recurrent_gated_delta
from qfd.models.loading import load_target


def reference_causal_conv(x, weight, activation=None, initial_state=None):
    assert activation == "silu" and initial_state is None
    C, K = weight.shape
    y = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), weight[:, None], groups=C)
    return F.silu(y).transpose(1, 2).to(x.dtype), None


def reference_chunk_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel=False):
    assert output_final_state
    rep = v.shape[2] // q.shape[2]
    q, k = (x.float().repeat_interleave(rep, dim=2) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return recurrent_gated_delta(q * scale, k, v.float(), g, beta.float(), initial_state)


@pytest.fixture
def cpu_package(monkeypatch):
    """gdn_fla as if the package ran here, with the references above."""
    monkeypatch.setattr(gdn_fla, "takes", lambda t: gdn_fla.BACKEND != "qfd" and not torch.is_grad_enabled())
    monkeypatch.setattr(gdn_fla, "_causal_conv", lambda: reference_causal_conv)
    monkeypatch.setattr(gdn_fla, "_chunk_rule", lambda: reference_chunk_rule)


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen3_5"])[0]


def _ids(length, seed=0):
    return torch.randint(0, 512, (1, length), generator=torch.Generator().manual_seed(seed))


def count_package_prompts(monkeypatch) -> list:
    """gdn_fla.prompt_conv_and_rule wrapped to record each call (one per GDN layer and prompt)."""
    calls, real = [], gdn_fla.prompt_conv_and_rule

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gdn_fla, "prompt_conv_and_rule", counted)
    return calls


def use(form, monkeypatch):
    """A long prompt's GDN through `form`: "qfd" (QFD_GDN_PREFILL=qfd), "fla" (the package's
    chunk rule after qfd's conv and gates), "fla_conv" (QFD_GDN_PROMPT_CONV=fla: its conv too)."""
    monkeypatch.setattr(gdn_fla, "BACKEND", "qfd" if form == "qfd" else "auto")
    monkeypatch.setattr(gdn_fla, "PROMPT_CONV", "fla" if form == "fla_conv" else "torch")


def _run(model, chunks, form, monkeypatch, keep=None):
    """Forward `chunks` through one cache, a prompt's GDN through `form` (`use`); optionally
    roll the last one back to `keep` of its tokens. Returns (logits of the last chunk, cache)."""
    use(form, monkeypatch)
    cache = model.new_cache(512)
    with torch.inference_mode():
        for ids in chunks:
            logits = model(ids, cache).logits
        if keep is not None:
            cache.rollback(cache.length - chunks[-1].shape[1] + keep)
    return logits, cache


def _assert_same_states(a, b):
    assert a.length == b.length
    for layer in a.gdn:
        torch.testing.assert_close(a.gdn[layer].conv, b.gdn[layer].conv, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.gdn[layer].recurrent, b.gdn[layer].recurrent, rtol=1e-4, atol=1e-5)


def test_the_package_conv_is_taken_only_for_prompts_when_asked(cpu_package, monkeypatch):
    x = torch.zeros(1, 17, 8)
    use("fla_conv", monkeypatch)
    with torch.inference_mode():
        assert gdn_fla.takes_prompt(x, 16) and not gdn_fla.takes_prompt(x[:, :16], 16)
        for form in ("qfd", "fla"):  # off, or the chunk rule only (tested below)
            use(form, monkeypatch)
            assert not gdn_fla.takes_prompt(x, 16)


def test_prompts_through_the_package_equal_qfds_path(model, cpu_package, monkeypatch):
    """A fresh 40-token prompt, then a 20-token continuation (conv history from the cache):
    logits and states equal qfd's own path; so does a rollback to 7 tokens of the second."""
    chunks = [_ids(40), _ids(20, seed=1)]
    calls = count_package_prompts(monkeypatch)
    for keep in (None, 7):
        want_logits, want = _run(model, chunks, "qfd", monkeypatch, keep)
        assert not calls
        got_logits, got = _run(model, chunks, "fla_conv", monkeypatch, keep)
        assert len(calls) == 2 * len(got.gdn)  # both prompts of every GDN layer went through the package path
        calls.clear()
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
        _assert_same_states(got, want)


def test_no_cache_forward_through_the_package_equals_qfds(model, cpu_package, monkeypatch):
    """Also the chunk rule alone (qfd's conv and gates before it, q/k/v handed over in bf16,
    hence the looser tolerance)."""
    ids = _ids(33, seed=2)
    with torch.inference_mode():
        use("qfd", monkeypatch)
        want = model(ids).logits
        for form, tol in (("fla_conv", 1e-4), ("fla", 1e-2)):
            use(form, monkeypatch)
            torch.testing.assert_close(model(ids).logits, want, rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-linear-attention runs on a GPU")
def test_the_packages_prompt_kernels_equal_qfds_path_on_the_gpu(tiny_checkpoints, monkeypatch):
    """The real conv + chunk rule (bf16 model) against qfd's own prompt path: logits within
    16-bit accuracy, states close, and the package's kernels ran (no fallback)."""
    from qfd import kernels

    if not gdn_fla.installed():
        pytest.skip("flash-linear-attention is not installed")
    gpu = load_target(tiny_checkpoints["qwen3_5"], device="cuda", dtype=torch.bfloat16)[0]
    chunks = [_ids(200).cuda(), _ids(70, seed=1).cuda()]
    want_logits, want = _run(gpu, chunks, "qfd", monkeypatch)
    calls = count_package_prompts(monkeypatch)
    got_logits, got = _run(gpu, chunks, "fla_conv", monkeypatch)
    assert not kernels._FAILED and len(calls) == 2 * len(got.gdn)
    scale = float(want_logits.abs().max())
    assert float((got_logits.float() - want_logits.float()).abs().max()) <= 5e-2 * scale
    for layer in got.gdn:
        a, b = got.gdn[layer].recurrent, want.gdn[layer].recurrent
        assert float((a - b).abs().max()) <= 5e-2 * float(b.abs().max())
