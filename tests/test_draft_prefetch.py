"""Draft prefetch (Engine.prefetch_draft, on with a graphed drafter on a GPU): a step ends by
launching the next step's draft, which the next step then uses. Forced on here on the CPU's
fixed-shape path: the tokens are those of the engine without it, for chains and trees, and
each step after the first uses the draft launched ahead (one draft call per step, plus the
one wasted when the generation ends)."""

from __future__ import annotations

import pytest
import torch

from qfd.engine import Engine
from qfd.models.loading import load_target
from tests.test_engine import greedy, make_drafter, prompt_ids


@pytest.mark.parametrize("tree", [0, 16])
def test_prefetched_drafts_give_the_same_tokens_one_draft_per_step(tiny_checkpoints, tree):
    torch.set_num_threads(1)
    model = load_target(tiny_checkpoints["llama"], tokenizer=False)[0]
    drafter = make_drafter(tiny_checkpoints["llama"])
    args = dict(drafter=drafter, max_len=128, cuda_graphs=True, tree_size=tree)
    plain, ahead = Engine(model, **args), Engine(model, prefetch_draft=True, **args)
    assert not plain.prefetch_draft and ahead.prefetch_draft  # off on the CPU by default
    calls = []
    inner = ahead.draft_step
    ahead.draft_step = lambda *a: calls.append(a) or inner(*a)
    prompt = prompt_ids(9, seed=3)
    expected = plain.generate(prompt, greedy(20))
    got = ahead.generate(prompt, greedy(20))
    assert got.tokens == expected.tokens
    assert len(calls) == got.stats.steps + 1  # each step's draft launched once, ahead; the last one unused
