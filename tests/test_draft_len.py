"""The draft length k (Engine(draft_len=k), `--draft-len`): each step verifies [last, d1..dk]
only. Greedy output stays token-identical to target-only for any k and any drafter, sampling
stays exact, the drafter's k tokens are the first k of its full draft, the stats have k
per-position entries, and a bad k is one error line from the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from qfd.engine import Engine
from qfd.errors import QfdError
from qfd.models.graphs import StaticDraftStep
from tests.test_engine import HYBRID_AND_DENSE, assert_first_two_tokens_follow_the_target, NEW, OracleDrafter, greedy, make_drafter, one_thread, prompt_ids, reference, targets  # noqa: F401 (fixtures)

B = 8  # make_drafter's and OracleDrafter's block size


@pytest.mark.parametrize("family", HYBRID_AND_DENSE)
@pytest.mark.parametrize("kind", ["untrained", "always_right", "always_wrong"])
@pytest.mark.parametrize("k", [1, 3, B - 1])
def test_greedy_with_any_draft_len_equals_target_only(targets, tiny_checkpoints, reference, family, kind, k):
    target = targets[family]
    drafter = make_drafter(tiny_checkpoints[family]) if kind == "untrained" else OracleDrafter(target, prompt_ids(), wrong=kind == "always_wrong")
    engine = Engine(target, drafter=drafter, max_len=128, draft_len=k)
    result = engine.generate(prompt_ids(), greedy())
    assert result.tokens == reference[family]
    stats = result.stats
    assert stats.block_size == k + 1 and len(stats.accept_per_position) == k
    if kind == "always_right":  # every step commits k drafts + the bonus, except where the budget cuts it
        assert stats.tau == k + 1 and stats.accept_per_position == [1.0] * k
        assert stats.steps == -(-(NEW - 1) // (k + 1))
    if kind == "always_wrong":
        assert stats.tau == 1.0 and stats.accept_per_position == [0.0] * k and stats.steps == NEW - 1


@pytest.mark.parametrize("family", HYBRID_AND_DENSE)
def test_fixed_shape_path_with_a_short_draft_len_is_token_identical(targets, tiny_checkpoints, reference, family):
    """Engine(cuda_graphs=True) captures the k+1 verify and a k-draft drafter step; on the CPU
    the same fixed-shape code runs eagerly and must emit the target-only tokens."""
    engine = Engine(targets[family], drafter=make_drafter(tiny_checkpoints[family]), max_len=128, cuda_graphs=True, draft_len=3)
    assert sorted(engine.forward.steps) == [1, 4] and engine.draft_step.num_drafts == 3
    result = engine.generate(prompt_ids(), greedy())
    assert result.tokens == reference[family] and len(result.stats.accept_per_position) == 3


@pytest.mark.parametrize("window", [None, 6])
def test_num_drafts_gives_the_first_k_of_the_full_draft(targets, tiny_checkpoints, window):
    target = targets["llama"]
    drafter = make_drafter(tiny_checkpoints["llama"])
    drafter.cfg = drafter.cfg.with_(sliding_window=window)
    cache = drafter.new_cache(64)
    torch.manual_seed(3)
    taps = torch.randn(1, 20, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size)
    drafter.append_context(cache, taps, 0)
    full_tokens, full_logits = drafter.draft(cache, 7, 20, embed=target.embed, head=target.head, return_logits=True)
    assert full_tokens.shape == (1, B - 1)
    for k in (1, 3, B - 1):
        tokens, logits = drafter.draft(cache, 7, 20, embed=target.embed, head=target.head, return_logits=True, num_drafts=k)
        assert torch.equal(tokens, full_tokens[:, :k])
        torch.testing.assert_close(logits, full_logits[:, :k], atol=1e-6, rtol=1e-6)
        step = StaticDraftStep(drafter, cache, embed=target.embed, head=target.head, use_graphs=False, num_drafts=k)
        with torch.inference_mode():
            assert torch.equal(step(7, 20), full_tokens[:, :k])
    for bad in (0, B):
        with pytest.raises(ValueError, match="num_drafts"):
            drafter.draft(cache, 7, 20, embed=target.embed, head=target.head, num_drafts=bad)


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_with_a_short_draft_len_follows_the_target(targets, k):
    """The second token comes from a verify step over k drafts of a 4-token block."""
    target = targets["qwen3_5"]
    prompt = prompt_ids(8)
    engine = Engine(target, drafter=OracleDrafter(target, prompt, block_size=4), max_len=64, draft_len=k)
    assert_first_two_tokens_follow_the_target(target, engine, prompt)


def test_engine_refuses_a_bad_draft_len(targets, tiny_checkpoints):
    target = targets["llama"]
    with pytest.raises(QfdError, match="needs a drafter"):
        Engine(target, max_len=32, draft_len=2)
    for bad in (0, B, -1):
        with pytest.raises(QfdError, match=f"must be in 1..{B - 1}"):
            Engine(target, drafter=make_drafter(tiny_checkpoints["llama"]), max_len=32, draft_len=bad)
    engine = Engine(target, drafter=make_drafter(tiny_checkpoints["llama"]), max_len=32)
    assert engine.draft_len == B - 1 and engine.verify_len == B  # the default: the whole block
    assert Engine(target, max_len=32).draft_len == 0


# --- the command line -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_drafter(tiny_chat_checkpoints, tmp_path_factory):
    """(target dir, drafter dir): an untrained block-4 drafter pinned to the tiny chat llama."""
    from qfd.manifest import write_manifest
    from qfd.models.drafter import DFlashDrafter, config_for_target, save_drafter

    target = tiny_chat_checkpoints["llama"]
    directory = tmp_path_factory.mktemp("draftlen") / "drafter"
    torch.manual_seed(0)
    config = json.loads((target / "config.json").read_text())
    save_drafter(DFlashDrafter(config_for_target(config, num_layers=1, block_size=4, intermediate_size=64)), directory, torch.float32)
    write_manifest(directory, stage="test", parents={"target": target})
    return target, directory


def _cli(argv, capsys):
    from qfd.cli import main

    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", ["generate", "serve", "eval"])
def test_cli_bad_draft_len_is_one_error_line(chat_drafter, capsys, command):
    target, drafter = map(str, chat_drafter)
    base = {"generate": ["generate", "--target", target, "--prompt", "hi", "--device", "cpu"],
            "serve": ["serve", "--target", target, "--device", "cpu", "--port", "0"],
            "eval": ["eval", "latency", "--target", target, "--device", "cpu"]}[command]
    cases = [(["--draft-len", "2"], "needs a drafter"), (["--drafter", drafter, "--draft-len", "4"], "must be in 1..3"), (["--drafter", drafter, "--draft-len", "0"], "--draft-len")]
    for flags, words in cases:
        code, out, err = _cli([*base, *flags], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, (flags, err)


def test_cli_generate_with_a_draft_len_reports_k_positions(chat_drafter, capsys):
    target, drafter = map(str, chat_drafter)
    code, out, err = _cli(["generate", "--target", target, "--prompt", "Hello", "--max-new-tokens", "8", "--device", "cpu", "--drafter", drafter, "--draft-len", "2"], capsys)
    assert code == 0, err
    rates = err.split("acceptance per draft position")[1].split()
    assert len(rates) == 2, err


def test_serve_builds_an_engine_with_the_draft_len(chat_drafter):
    from qfd.stages.serve import ServeConfig
    from tests.test_draft_vocab import served_engine

    target, drafter = map(str, chat_drafter)
    with served_engine(target=target, drafter=drafter, draft_len=2) as engine:
        assert engine.draft_len == 2 and engine.verify_len == 3
    with pytest.raises(QfdError, match="--engine qfd"):
        from qfd.stages.serve import run

        run(ServeConfig(target=target, drafter=drafter, engine="vllm", draft_len=2))
