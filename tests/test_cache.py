"""Cache rollback: after rolling back to a prefix, caches, states and later logits equal those
of a run over the prefix alone (method.md section 4: rejected draft tokens leave no trace)."""

from __future__ import annotations

import pytest
import torch

from qfd.models.loading import load_target
from tests.tiny import FAMILIES

ATOL = 1e-5


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    return {family: load_target(path)[0] for family, path in tiny_checkpoints.items()}


def _ids(length, seed=0):
    return torch.randint(0, 512, (1, length), generator=torch.Generator().manual_seed(seed))


def _assert_same_state(cache, fresh, length):
    assert cache.length == fresh.length == length
    for layer in cache.k:
        torch.testing.assert_close(cache.k[layer][:, :, :length], fresh.k[layer][:, :, :length], atol=ATOL, rtol=0)
        torch.testing.assert_close(cache.v[layer][:, :, :length], fresh.v[layer][:, :, :length], atol=ATOL, rtol=0)
    for layer in cache.gdn:
        torch.testing.assert_close(cache.gdn[layer].conv, fresh.gdn[layer].conv, atol=ATOL, rtol=0)
        torch.testing.assert_close(cache.gdn[layer].recurrent, fresh.gdn[layer].recurrent, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("accepted", [0, 1, 7, 16])
@torch.no_grad()
def test_rollback_after_verify_equals_running_the_prefix_alone(models, family, accepted):
    model = models[family]
    prompt, block, after = _ids(12), _ids(16, seed=1), _ids(3, seed=2)
    cache = model.new_cache(64)
    model(prompt, cache)
    model(block, cache)  # verify 16 draft tokens, then keep only `accepted` of them
    cache.rollback(12 + accepted)
    kept = torch.cat([prompt, block[:, :accepted]], 1)
    fresh = model.new_cache(64)
    model(kept, fresh)
    _assert_same_state(cache, fresh, kept.shape[1])
    # and decoding continues as if the rejected tokens had never been seen
    continued = torch.cat([model(after[:, t : t + 1], cache).logits for t in range(3)], 1)
    reference = model(torch.cat([kept, after], 1)).logits[:, -3:]
    torch.testing.assert_close(continued, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("accepted", [0, 5, 23])
@torch.no_grad()
def test_rollback_into_a_long_chunked_forward_recomputes_exactly(models, accepted):
    """Forwards longer than max_verify keep no per-position history; rollback recomputes."""
    model = models["qwen3_5"]
    prompt = _ids(24)
    cache = model.new_cache(64, max_verify=16)
    model(prompt, cache)
    cache.rollback(accepted)
    fresh = model.new_cache(64)
    if accepted:
        model(prompt[:, :accepted], fresh)
    _assert_same_state(cache, fresh, accepted)


@torch.no_grad()
def test_repeated_rollbacks_within_one_forward(models):
    model = models["qwen3_5"]
    ids = _ids(20)
    cache = model.new_cache(32)
    model(ids[:, :4], cache)
    model(ids[:, 4:20], cache)
    cache.rollback(15)
    cache.rollback(9)  # still inside the last forward
    fresh = model.new_cache(32)
    model(ids[:, :9], fresh)
    _assert_same_state(cache, fresh, 9)


@torch.no_grad()
def test_rollback_outside_the_last_forward_and_overflow_are_refused(models):
    model = models["qwen3_5"]
    cache = model.new_cache(10)
    model(_ids(4), cache)
    model(_ids(4), cache)
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback(3)
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback(9)
    with pytest.raises(ValueError, match="cache full"):
        model(_ids(3), cache)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_reset_starts_a_new_sequence(models, family):
    model = models[family]
    cache = model.new_cache(32)
    model(_ids(9, seed=3), cache)
    cache.reset()
    ids = _ids(6)
    torch.testing.assert_close(model(ids, cache).logits, model(ids).logits, atol=1e-4, rtol=0)


@torch.no_grad()
def test_the_conv_window_is_channels_last_and_either_layout_gives_the_same_steps(models, monkeypatch):
    """Through a cache the GDN conv window is a channels-last view ([B, K-1+T, C] memory, what
    the step kernels read through strides); QFD_GDN_WINDOW=channels_first builds it as before.
    Both give the same logits and states through a verify and its rollback."""
    from qfd.models import gdn

    model = models["qwen3_5"]
    prompt, block = _ids(12), _ids(16, seed=1)
    results = []
    for channels_last in (True, False):
        monkeypatch.setattr(gdn, "CHANNELS_LAST_WINDOW", channels_last)
        cache = model.new_cache(64)
        model(prompt, cache)
        logits = model(block, cache).logits
        window = next(iter(cache.gdn.values())).window
        assert (window.stride(1) == 1) is channels_last
        cache.rollback(12 + 5)
        results.append((logits, cache))
    torch.testing.assert_close(results[0][0], results[1][0], atol=ATOL, rtol=0)
    _assert_same_state(results[0][1], results[1][1], 12 + 5)
