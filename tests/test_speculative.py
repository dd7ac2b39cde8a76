"""Verification math: greedy acceptance and the rejection sampler preserve the target's choices
and distribution (method.md section 4; Leviathan et al. 2023, Algorithm 1)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from qfd.speculative import SamplingParams, target_probs, verify, verify_greedy, verify_sampling


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls run fastest (and steadiest on a busy box) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_greedy_accepts_the_longest_matching_prefix_plus_the_bonus():
    logits = torch.full((5, 10), -5.0)
    choice = [3, 1, 4, 1, 5]
    for i, c in enumerate(choice):
        logits[i, c] = 5.0
    assert verify_greedy(torch.tensor([3, 1, 4, 1]), logits).tokens == [3, 1, 4, 1, 5]  # all + bonus
    v = verify_greedy(torch.tensor([3, 1, 9, 1]), logits)  # later match after a miss does not count
    assert (v.accepted, v.tokens) == (2, [3, 1, 4])
    v = verify_greedy(torch.tensor([7, 1, 4, 1]), logits)
    assert (v.accepted, v.tokens) == (0, [3])
    v = verify_greedy(torch.tensor([], dtype=torch.long), logits[:1])  # target-only: B = 1
    assert (v.accepted, v.tokens) == (0, [3])


def test_target_probs_filters_as_documented():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (p > 0).tolist() == [True, True, False, False, False]  # smallest set reaching top_p
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # the top token always stays
    assert target_probs(logits, SamplingParams()).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    hot = target_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(hot, (logits / 0.5).softmax(-1))


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token the target gives probability 0"
    kept = probs[keep].double()
    expected = kept / kept.sum() * counts.sum().double()
    return float(chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


PARAMS = [SamplingParams(1.3, top_p=0.8), SamplingParams(0.9, top_p=0.9, top_k=6)]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}")
@pytest.mark.parametrize("drafter", ["stochastic", "deterministic"])
def test_rejection_sampling_follows_the_target_distribution(params, drafter):
    """The first committed token is distributed as p whatever the drafter proposes; given the
    first draft was accepted, the second committed token is distributed as the next row of p."""
    torch.manual_seed(0)
    V, N = 8, 2500
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V) * 1.5
    p = target_probs(logits, params)
    q = torch.randn(2, V).softmax(-1) if drafter == "stochastic" else None
    first = torch.zeros(V)
    second = torch.zeros(V)
    fixed_draft = torch.tensor([int(p[0].argmin()), int(p[1].argmax())])  # one bad, one good guess
    for _ in range(N):
        if q is None:
            draft = fixed_draft
        else:
            draft = torch.multinomial(q, 1, generator=gen).view(-1)
        v = verify_sampling(draft, p, q, gen)
        first[v.tokens[0]] += 1
        if v.accepted >= 1:
            second[v.tokens[1]] += 1
    assert _chi2_pvalue(first, p[0]) > 1e-3
    if second.sum() > 200:
        assert _chi2_pvalue(second, p[1]) > 1e-3


def test_rejection_sampling_accepts_a_draft_that_equals_a_sure_target():
    p = torch.zeros(3, 4)
    p[0, 2] = p[1, 1] = p[2, 3] = 1.0
    v = verify_sampling(torch.tensor([2, 1]), p)
    assert (v.accepted, v.tokens) == (2, [2, 1, 3])
    v = verify_sampling(torch.tensor([0, 1]), p)
    assert (v.accepted, v.tokens) == (0, [2])


def test_verify_dispatches_greedy_and_sampling():
    logits = torch.randn(4, 16)
    draft = logits.argmax(-1)[:3]
    assert verify(draft, logits, SamplingParams()).accepted == 3
    v = verify(draft, logits, SamplingParams(1.0), generator=torch.Generator().manual_seed(0))
    assert len(v.tokens) == v.accepted + 1
