"""The fixed-shape (CUDA-graph) steps equal the dynamic paths; run eagerly on the CPU."""

from __future__ import annotations

import pytest
import torch

from qfd.models.graphs import StaticAppendStep, StaticDraftStep, StaticTargetSteps

KEEPS = [3, 16, 1, 7]  # tokens kept of each verified 16-token block (rollback)
TAPS = (1, 2)


def assert_steps_follow_the_dynamic_cache(model, steps, dynamic, static_cache) -> None:
    """A prompt, four 16-token verify blocks each kept in part (`KEEPS`: GDN states restored per
    position), then a decode step: the fixed-shape steps on the static cache give the dynamic
    path's logits and taps at every step."""
    torch.manual_seed(1)
    prompt = torch.randint(0, 512, (1, 20))
    blocks = [torch.randint(0, 512, (1, 16)) for _ in KEEPS]
    with torch.inference_mode():
        ref = model(prompt, dynamic, tap_layers=TAPS)
        got = steps(prompt, static_cache, tap_layers=TAPS)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
        for block, keep in zip(blocks, KEEPS):
            ref = model(block, dynamic, tap_layers=TAPS)
            got = steps(block, static_cache, tap_layers=TAPS)
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.taps, ref.taps, atol=1e-5, rtol=1e-5)
            dynamic.rollback(dynamic.length - 16 + keep)
            static_cache.rollback(static_cache.length - 16 + keep)
        one = torch.randint(0, 512, (1, 1))
        torch.testing.assert_close(steps(one, static_cache, tap_layers=TAPS).logits, model(one, dynamic, tap_layers=TAPS).logits, atol=1e-5, rtol=1e-5)
    assert static_cache.length == dynamic.length


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_static_target_steps_match_dynamic_cache(tiny_checkpoints, family):
    from qfd.models.loading import load_target

    model, _ = load_target(tiny_checkpoints[family], tokenizer=False)
    static_cache = model.new_cache(128 + 16, static=True)
    steps = StaticTargetSteps(model, static_cache, sizes=(1, 16), tap_layers=TAPS, use_graphs=False)
    assert_steps_follow_the_dynamic_cache(model, steps, model.new_cache(128), static_cache)


@pytest.mark.parametrize("window", [None, 8])
def test_static_draft_step_matches_draft(tiny_checkpoints, window):
    from qfd.checkpoint import read_json
    from qfd.models.drafter import DFlashDrafter, config_for_target
    from qfd.models.loading import load_target

    model, _ = load_target(tiny_checkpoints["llama"], tokenizer=False)
    torch.manual_seed(0)
    cfg = config_for_target(read_json(tiny_checkpoints["llama"] / "config.json"), num_layers=2, taps=(1, 2), sliding_window=window)
    drafter = DFlashDrafter(cfg).eval()
    cache = drafter.new_cache(64)
    step = StaticDraftStep(drafter, cache, embed=model.embed, head=model.head, use_graphs=False)
    taps = torch.randn(1, 40, 2 * cfg.hidden_size)
    drafter.append_context(cache, taps[:, :5], 0)
    with torch.inference_mode():
        for start in (5, 17, 30):
            if start > cache.length:
                drafter.append_context(cache, taps[:, cache.length : start], cache.length)
            expected = drafter.draft(cache, 7, start, embed=model.embed, head=model.head)
            assert torch.equal(step(7, start), expected)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_engine_fixed_shape_path_is_token_identical(tiny_checkpoints, family):
    """Engine(cuda_graphs=True) - on the CPU the same fixed-shape steps, run eagerly - emits
    exactly the tokens of the dynamic engine, with a drafter (block 4) and target-only."""
    from qfd.checkpoint import read_json
    from qfd.engine import Engine, GenerationConfig
    from qfd.models.drafter import DFlashDrafter, config_for_target
    from qfd.models.loading import load_target

    model, _ = load_target(tiny_checkpoints[family], tokenizer=False)
    torch.manual_seed(0)
    cfg = config_for_target(read_json(tiny_checkpoints[family] / "config.json"), num_layers=1, taps=(1, 2), block_size=4, mask_token_id=511)
    drafter = DFlashDrafter(cfg).eval()
    prompt = torch.randint(3, 500, (12,)).tolist()
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    for d in (drafter, None):
        dynamic = Engine(model, drafter=d, max_len=64).generate(prompt, config)
        fixed = Engine(model, drafter=d, max_len=64, cuda_graphs=True).generate(prompt, config)
        assert fixed.tokens == dynamic.tokens


def _tiny_drafter(tiny_checkpoints, **kwargs):
    from qfd.checkpoint import read_json
    from qfd.models.drafter import DFlashDrafter, config_for_target
    from qfd.models.loading import load_target

    model, _ = load_target(tiny_checkpoints["llama"], tokenizer=False)
    torch.manual_seed(0)
    cfg = config_for_target(read_json(tiny_checkpoints["llama"] / "config.json"), num_layers=2, taps=(1, 2), **kwargs)
    return model, DFlashDrafter(cfg).eval()


@pytest.mark.parametrize("compiled", [False, True])
def test_static_append_step_matches_append_context(tiny_checkpoints, compiled):
    """The fixed-size append (all `rows` tap rows written, the length counting n) leaves the
    same valid context as the eager append, whatever stale rows it also wrote, and the drafts
    read from it are the same; past the cache's room it falls back to the eager append. Also
    with its projections torch.compile'd (aot_eager: the same graph capture and guards, no
    codegen), the cache writes outside them."""
    model, drafter = _tiny_drafter(tiny_checkpoints)
    rows, width = 5, 2 * drafter.cfg.hidden_size
    eager, fixed = drafter.new_cache(40), drafter.new_cache(40)
    step = StaticAppendStep(drafter, fixed, rows=rows, use_graphs=False, compile=compiled, compile_backend="aot_eager")
    torch.manual_seed(3)
    with torch.inference_mode():
        prompt = torch.randn(1, 6, width)
        drafter.append_context(eager, prompt, 0)
        drafter.append_context(fixed, prompt, 0)
        for n in (1, 5, 2, 3, 4, 5, 5, 5):  # committed tokens per step; the last ones reach the end
            verify_taps = torch.randn(1, rows, width)
            start = eager.length
            drafter.append_context(eager, verify_taps[:, :n], start)
            step(verify_taps[:, :n], start)
            assert fixed.length == eager.length == start + n
            valid = eager.length
            torch.testing.assert_close(fixed.k[:, :, :, :valid], eager.k[:, :, :, :valid], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fixed.v[:, :, :, :valid], eager.v[:, :, :, :valid], atol=1e-5, rtol=1e-5)
            a = drafter.draft(eager, 7, valid, embed=model.embed, head=model.head, return_logits=True)[1]
            b = drafter.draft(fixed, 7, valid, embed=model.embed, head=model.head, return_logits=True)[1]
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert fixed.length + rows > fixed.max_len  # the fallback ran


def test_engine_with_graph_append_is_token_identical(tiny_checkpoints):
    """An engine whose drafter context goes through StaticAppendStep (on CUDA it does with
    cuda_graphs; forced here on the CPU) emits the target-only tokens with the same acceptance
    as the eager engine."""
    from qfd.engine import Engine, GenerationConfig

    model, drafter = _tiny_drafter(tiny_checkpoints, block_size=4, mask_token_id=511)
    prompt = torch.randint(3, 500, (12,)).tolist()
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    reference = Engine(model, max_len=64).generate(prompt, config)
    eager = Engine(model, drafter=drafter, max_len=64).generate(prompt, config)
    engine = Engine(model, drafter=drafter, max_len=64, cuda_graphs=True)
    assert engine.append_step is None  # the CPU default: the eager append
    engine.append_step = StaticAppendStep(drafter, engine.draft_cache, rows=engine.verify_len, use_graphs=False)
    got = engine.generate(prompt, config)
    assert got.tokens == eager.tokens == reference.tokens
    assert got.stats.steps == eager.stats.steps
