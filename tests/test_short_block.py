"""The short block (Engine(short_block=True), `--short-block`): with draft length k the drafter
runs only the k + 1 block slots it verifies. Its drafts are those of the same drafter with
block size k + 1 (the definition), the fixed-shape step matches the eager one, greedy output
stays token-identical to target-only and a bad block length is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from qfd.engine import Engine
from qfd.models.graphs import StaticDraftStep
from tests.test_engine import HYBRID_AND_DENSE, greedy, make_drafter, prompt_ids, reference, targets  # noqa: F401 (fixtures)

B = 8  # make_drafter's block size


def drafter_with_context(tiny_checkpoints, window=None):
    drafter = make_drafter(tiny_checkpoints["llama"])
    drafter.cfg = drafter.cfg.with_(sliding_window=window)
    cache = drafter.new_cache(64)
    torch.manual_seed(3)
    drafter.append_context(cache, torch.randn(1, 20, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size), 0)
    return drafter, cache


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("n", [2, 4, B])
def test_block_len_n_drafts_like_a_drafter_of_block_size_n(targets, tiny_checkpoints, window, n):
    target = targets["llama"]
    drafter, cache = drafter_with_context(tiny_checkpoints, window)
    short = copy.deepcopy(drafter)
    short.cfg = drafter.cfg.with_(block_size=n)  # same weights, a block of n slots
    expected_tokens, expected_logits = short.draft(cache, 7, 20, embed=target.embed, head=target.head, return_logits=True)
    tokens, logits = drafter.draft(cache, 7, 20, embed=target.embed, head=target.head, return_logits=True, block_len=n)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, atol=1e-6, rtol=1e-6)
    step = StaticDraftStep(drafter, cache, embed=target.embed, head=target.head, use_graphs=False, num_drafts=n - 1, block_len=n)
    with torch.inference_mode():
        assert torch.equal(step(7, 20), expected_tokens)


def test_a_short_block_changes_the_drafts_of_a_full_one(targets, tiny_checkpoints):
    """The slots attend to each other: cutting the block is not the first k of a full draft
    (which is why it is an option, measured by bench_e2e --short-block)."""
    target = targets["llama"]
    drafter, cache = drafter_with_context(tiny_checkpoints)
    _, full = drafter.draft(cache, 7, 20, embed=target.embed, head=target.head, return_logits=True, num_drafts=2)
    _, short = drafter.draft(cache, 7, 20, embed=target.embed, head=target.head, return_logits=True, num_drafts=2, block_len=3)
    assert not torch.allclose(full, short)


def test_bad_block_lengths_are_refused(targets, tiny_checkpoints):
    target = targets["llama"]
    drafter, cache = drafter_with_context(tiny_checkpoints)
    for block_len, k in ((1, None), (B + 1, None), (3, 3)):
        with pytest.raises(ValueError, match="block_len"):
            drafter.draft(cache, 7, 20, embed=target.embed, head=target.head, num_drafts=k, block_len=block_len)
        with pytest.raises(ValueError, match="block_len"):
            StaticDraftStep(drafter, cache, embed=target.embed, head=target.head, use_graphs=False, num_drafts=k, block_len=block_len)


@pytest.mark.parametrize("family", HYBRID_AND_DENSE)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_short_block_equals_target_only(targets, tiny_checkpoints, reference, family, static, k):
    engine = Engine(targets[family], drafter=make_drafter(tiny_checkpoints[family]), max_len=128, draft_len=k, short_block=True, cuda_graphs=static)
    assert engine.draft_block_len == k + 1
    if static:
        assert engine.draft_step.block_len == k + 1
    result = engine.generate(prompt_ids(), greedy())
    assert result.tokens == reference[family]


def test_short_block_without_a_draft_len_runs_the_whole_block(targets, tiny_checkpoints):
    engine = Engine(targets["llama"], drafter=make_drafter(tiny_checkpoints["llama"]), max_len=64, short_block=True)
    assert engine.draft_len == B - 1 and engine.draft_block_len == B


# --- the CLI: --short-block on generate, serve and eval ------------------------------------------
from tests.test_draft_vocab import _cli, _one_error_line, chat_drafters, engine_command, served_engine  # noqa: E402,F401 (helpers, fixture)


@pytest.mark.parametrize("command", ["generate", "serve", "eval"])
def test_cli_short_block_without_a_draft_len_is_one_error_line(chat_drafters, capsys, command):
    target, plain, _ = map(str, chat_drafters)
    _one_error_line(*_cli([*engine_command(command, target), "--drafter", plain, "--short-block"], capsys)[::2], "--short-block needs --draft-len")


@pytest.mark.parametrize("command", ["generate", "serve", "eval"])
def test_cli_short_block_without_a_drafter_is_one_error_line(chat_drafters, capsys, command):
    """One shared check (`check_speculation_flags`) for the three commands: with no drafter the
    line names the drafter, not only the draft length."""
    target = str(chat_drafters[0])
    _one_error_line(*_cli([*engine_command(command, target), "--short-block"], capsys)[::2], "--short-block needs a drafter")


def test_cli_generate_and_serve_with_a_short_block(chat_drafters, capsys):
    from qfd.stages.serve import ServeConfig, run

    target, plain, _ = map(str, chat_drafters)
    argv = ["generate", "--target", target, "--prompt", "Hello", "--max-new-tokens", "8", "--device", "cpu", "--drafter", plain, "--draft-len", "2"]
    code, full_out, err = _cli(argv, capsys)
    assert code == 0, err
    code, out, err = _cli([*argv, "--short-block"], capsys)
    assert code == 0, err
    assert out == full_out  # greedy: the same text whatever the drafter proposes
    with served_engine(target=target, drafter=plain, draft_len=2, short_block=True) as engine:
        assert engine.short_block and engine.draft_block_len == 3
    with pytest.raises(Exception, match="--engine qfd"):
        run(ServeConfig(target=target, drafter=plain, engine="vllm", draft_len=2, short_block=True))
