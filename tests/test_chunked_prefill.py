"""Chunked prefill (Engine(chunked_prefill=True), StaticTargetSteps.prefill): a prompt run as
replays of a fixed-size step - the last chunk padded and cut back - leaves the cache and the
first token exactly as the one eager prompt forward does, for chains, target-only engines
and trees (the tree step verifying a chain), attention and Gated DeltaNet. On the CPU the
fixed-shape steps run eagerly: the same code the GPU replays."""

from __future__ import annotations

import pytest
import torch

from qfd.engine import GRAPHED_PREFILL_MAX_TOKENS, Engine
from qfd.models.loading import load_target
from tests.test_engine import greedy, make_drafter, prompt_ids
from tests.test_tree import assert_cache_holds


@pytest.fixture(scope="module")
def targets(tiny_checkpoints):
    torch.set_num_threads(1)
    return {family: load_target(tiny_checkpoints[family], tokenizer=False)[0] for family in ("llama", "qwen3_5")}


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("system", ["target-only", "chain", "tree"])
@pytest.mark.parametrize("prompt_len", [5, 16, 37])
def test_chunked_prefill_equals_the_eager_prompt_forward(targets, tiny_checkpoints, family, system, prompt_len):
    model = targets[family]
    drafter = None if system == "target-only" else make_drafter(tiny_checkpoints[family])
    args = dict(drafter=drafter, max_len=128, cuda_graphs=True, tree_size=16 if system == "tree" else 0)
    prompt = prompt_ids(prompt_len, seed=prompt_len)
    plain = Engine(model, chunked_prefill=False, **args)
    chunked = Engine(model, chunked_prefill=True, **args)
    assert chunked.prefill_chunk == 16 and plain.prefill_chunk == 0
    checked = []

    def first_step_cache_is_a_fresh_runs(state):  # after the first step: prompt + committed, nothing more
        if not checked:
            assert_cache_holds(model, state["cache"], state["committed"])
            checked.append(True)

    chunked.on_step = first_step_cache_is_a_fresh_runs
    assert chunked.generate(prompt, greedy(12)).tokens == plain.generate(prompt, greedy(12)).tokens
    assert checked


def test_chunked_prefill_default_is_off_on_the_cpu_and_long_prompts_stay_eager(targets, monkeypatch):
    model = targets["llama"]
    assert Engine(model, max_len=64, cuda_graphs=True).prefill_chunk == 0
    engine = Engine(model, max_len=64, cuda_graphs=True, chunked_prefill=True)
    calls = []
    monkeypatch.setattr(engine.forward, "prefill", lambda *a: calls.append(a) or pytest.fail("long prompt chunked"))
    monkeypatch.setattr("qfd.engine.GRAPHED_PREFILL_MAX_TOKENS", 8)
    engine.generate(prompt_ids(12), greedy(4))
    assert not calls and GRAPHED_PREFILL_MAX_TOKENS >= 16
