"""The fixed-shape (CUDA-graph) steps equal the dynamic paths; run eagerly on the CPU."""

from __future__ import annotations

import pytest
import torch

from qfd.models.graphs import StaticDraftStep, StaticTargetSteps


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_static_target_steps_match_dynamic_cache(tiny_checkpoints, family):
    from qfd.models.loading import load_target

    model, _ = load_target(tiny_checkpoints[family], tokenizer=False)
    torch.manual_seed(1)
    prompt = torch.randint(0, 512, (1, 20))
    blocks = [torch.randint(0, 512, (1, 16)) for _ in range(4)]
    keeps = [3, 16, 1, 7]  # tokens kept of each verified block (rollback)
    taps = (1, 2)

    dynamic = model.new_cache(128)
    static_cache = model.new_cache(128 + 16, static=True)
    steps = StaticTargetSteps(model, static_cache, sizes=(1, 16), tap_layers=taps, use_graphs=False)
    with torch.inference_mode():
        ref = model(prompt, dynamic, tap_layers=taps)
        got = steps(prompt, static_cache, tap_layers=taps)
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
        for block, keep in zip(blocks, keeps):
            ref = model(block, dynamic, tap_layers=taps)
            got = steps(block, static_cache, tap_layers=taps)
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.taps, ref.taps, atol=1e-5, rtol=1e-5)
            dynamic.rollback(dynamic.length - 16 + keep)
            static_cache.rollback(static_cache.length - 16 + keep)
        one = torch.randint(0, 512, (1, 1))
        torch.testing.assert_close(steps(one, static_cache, tap_layers=taps).logits, model(one, dynamic, tap_layers=taps).logits, atol=1e-5, rtol=1e-5)
    assert static_cache.length == dynamic.length


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
