"""The DFlash drafter model: inference path == training path, SWA, save/reload, target checks."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from qfd.errors import QfdError
from qfd.models.drafter import (
    DFlashConfig,
    DFlashDrafter,
    config_for_target,
    default_tap_layers,
    load_drafter,
    pick_mask_token_id,
    read_drafter_config,
    save_drafter,
    verify_drafter_target,
)

VOCAB, HIDDEN = 64, 32


def tiny_cfg(**overrides) -> DFlashConfig:
    base = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=VOCAB, target_layer_ids=(1, 2), mask_token_id=VOCAB - 1, num_target_layers=5, block_size=4)
    base.update(overrides)
    return DFlashConfig(**base)


@pytest.fixture()
def parts():
    torch.manual_seed(0)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    taps = torch.randn(1, 24, 2 * HIDDEN)
    ids = torch.randint(0, VOCAB - 1, (24,))
    return embed, head, taps, ids


def drafts_via_cache(drafter, embed, head, taps, ids, anchor, chunks=(5,)):
    """Fill the cache in pieces (as the engine does after each verify), then draft at anchor."""
    cache = drafter.new_cache(64)
    pos = 0
    while pos < anchor:
        n = min(chunks[0], anchor - pos)
        drafter.append_context(cache, taps[:, pos : pos + n], pos)
        pos += n
    return drafter.draft(cache, ids[anchor], anchor, embed, head, return_logits=True)


@pytest.mark.parametrize("window", [None, 6])
def test_draft_on_cache_equals_training_forward(parts, window):
    embed, head, taps, ids = parts
    drafter = DFlashDrafter(tiny_cfg(sliding_window=window)).eval()
    anchors = torch.tensor([3, 9, 15, 20])
    logits_train = head(drafter.forward_train(taps, ids, anchors, embed))  # [N, B-1, V]
    for i, a in enumerate(anchors.tolist()):
        tokens, logits = drafts_via_cache(drafter, embed, head, taps, ids, a)
        assert tokens.shape == (1, drafter.block_size - 1)
        torch.testing.assert_close(logits[0], logits_train[i], atol=1e-5, rtol=1e-5)
        assert torch.equal(tokens[0], logits_train[i].argmax(-1))


@pytest.mark.parametrize("window", [None, 6])
def test_batched_blocks_of_padded_sequences_equal_one_sequence_forward(parts, window):
    """forward_blocks over two right-padded sequences == forward_train on each one alone."""
    embed, head, taps, ids = parts
    drafter = DFlashDrafter(tiny_cfg(sliding_window=window)).eval()
    short_len = 15
    taps2 = torch.zeros(2, 24, taps.shape[-1])
    taps2[0], taps2[1, :short_len] = taps[0], taps[0, :short_len] * 0.5
    taps2[1, short_len:] = 7.0  # padding: must not matter
    ids2 = torch.stack([ids, torch.cat([ids[:short_len].flip(0), torch.zeros(24 - short_len, dtype=torch.long)])])
    anchors_a, anchors_b = torch.tensor([3, 9, 20]), torch.tensor([1, 8, 13])
    out = drafter.forward_blocks(taps2, ids2, torch.tensor([0, 0, 0, 1, 1, 1]), torch.cat([anchors_a, anchors_b]), embed)
    torch.testing.assert_close(out[:3], drafter.forward_train(taps, ids, anchors_a, embed), atol=1e-5, rtol=1e-5)
    alone = drafter.forward_train(taps2[1:, :short_len], ids2[1, :short_len], anchors_b, embed)
    torch.testing.assert_close(out[3:], alone, atol=1e-5, rtol=1e-5)


def test_training_blocks_do_not_see_each_other_or_the_future(parts):
    embed, head, taps, ids = parts
    drafter = DFlashDrafter(tiny_cfg()).eval()
    anchors = torch.tensor([4, 12])
    base = drafter.forward_train(taps, ids, anchors, embed)
    changed_taps = taps.clone()
    changed_taps[:, 12:] += 5.0  # context at and after the second anchor
    changed_ids = ids.clone()
    changed_ids[12] = (ids[12] + 1) % (VOCAB - 1)  # slot 0 of the second block
    other = drafter.forward_train(changed_taps, changed_ids, anchors, embed)
    torch.testing.assert_close(other[0], base[0])  # first block unaffected
    assert not torch.allclose(other[1], base[1])


def test_sliding_window_at_least_context_equals_full_attention_exactly(parts):
    embed, head, taps, ids = parts
    full = DFlashDrafter(tiny_cfg()).eval()
    wide = DFlashDrafter(tiny_cfg(sliding_window=24)).eval()
    narrow = DFlashDrafter(tiny_cfg(sliding_window=3)).eval()
    wide.load_state_dict(full.state_dict())
    narrow.load_state_dict(full.state_dict())
    anchors = torch.tensor([2, 10, 20])
    out_full = full.forward_train(taps, ids, anchors, embed)
    assert torch.equal(wide.forward_train(taps, ids, anchors, embed), out_full)
    assert not torch.allclose(narrow.forward_train(taps, ids, anchors, embed), out_full)
    _, logits_full = drafts_via_cache(full, embed, head, taps, ids, 20)
    _, logits_wide = drafts_via_cache(wide, embed, head, taps, ids, 20)
    _, logits_narrow = drafts_via_cache(narrow, embed, head, taps, ids, 20)
    assert torch.equal(logits_wide, logits_full)
    assert not torch.allclose(logits_narrow, logits_full)


def test_cache_rollback_then_append_matches_fresh_cache(parts):
    embed, head, taps, ids = parts
    drafter = DFlashDrafter(tiny_cfg()).eval()
    cache = drafter.new_cache(64)
    drafter.append_context(cache, torch.randn(1, 16, 2 * HIDDEN), 0)  # junk beyond position 10
    cache.rollback(10)
    assert cache.length == 10
    drafter.append_context(cache, taps[:, :14], 0)
    _, logits = drafter.draft(cache, ids[14], 14, embed, head, return_logits=True)
    _, expected = drafts_via_cache(drafter, embed, head, taps, ids, 14)
    torch.testing.assert_close(logits, expected)
    with pytest.raises(ValueError):
        drafter.append_context(cache, taps[:, :2], 20)  # a gap


def test_saved_drafter_reloads_identically(tmp_path, parts):
    embed, head, taps, ids = parts
    drafter = DFlashDrafter(tiny_cfg(sliding_window=7)).eval()
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 2], "block_size": 4, "causal": False}
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 7
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "layers.0.self_attn.k_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's, not saved
    reloaded = load_drafter(tmp_path)
    assert reloaded.cfg == drafter.cfg
    anchors = torch.tensor([5, 17])
    assert torch.equal(reloaded.forward_train(taps, ids, anchors, embed), drafter.forward_train(taps, ids, anchors, embed))
    assert torch.equal(drafts_via_cache(reloaded, embed, head, taps, ids, 17)[1], drafts_via_cache(drafter, embed, head, taps, ids, 17)[1])


def test_checkpoint_inspect_accepts_drafter_dirs(tmp_path):
    from qfd.checkpoint import inspect_model_dir

    save_drafter(DFlashDrafter(tiny_cfg()), tmp_path)
    assert inspect_model_dir(tmp_path).family == "dflash"


def test_tap_layers_and_mask_token_choice():
    assert default_tap_layers(32) == (1, 8, 15, 22, 29)
    assert default_tap_layers(36) == (1, 9, 17, 25, 33)
    assert default_tap_layers(4) == (1,)
    assert all(0 <= t < 6 for t in default_tap_layers(6))

    class Tok:
        bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 2, 0
        chat_template = "<|im_start|>{{ m }}<|im_end|>"
        added_tokens_decoder = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 5: "<file_sep>", 9: "<empty>"}

        def __len__(self):
            return self.size

    class Special(str):
        special = True

    tok = Tok()
    tok.added_tokens_decoder = {k: Special(v) for k, v in Tok.added_tokens_decoder.items()}
    tok.size = 100
    assert pick_mask_token_id(120, tok) == 100  # first padding row beyond the tokenizer
    tok.size = 120
    assert pick_mask_token_id(120, tok) == 9  # an unused special token
    assert pick_mask_token_id(120, None) == 119


def _commit_drafter(path, target_dir, cfg):
    from qfd.checkpoint import Staging

    staging = Staging(path, overwrite=True)
    save_drafter(DFlashDrafter(cfg), staging.path)
    return staging.commit(stage="draft-stage1", parents={"target": target_dir})


def test_manifest_pins_target_fingerprint(tmp_path, tiny_checkpoints):
    llama, qwen3 = tiny_checkpoints["llama"], tiny_checkpoints["qwen3"]
    target_config = json.loads((llama / "config.json").read_text())
    cfg = config_for_target(target_config, None, num_layers=1, block_size=4)
    drafter_dir = _commit_drafter(tmp_path / "d", llama, cfg)
    verify_drafter_target(drafter_dir, llama)  # the pinned target: fine
    with pytest.raises(QfdError, match="fingerprint"):
        verify_drafter_target(drafter_dir, qwen3)  # same shapes, other weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verify_drafter_target(drafter_dir, qwen3, allow_mismatch=True)
    assert any("fingerprint" in str(w.message) for w in caught)
    # Modified weights in a copy of the target change its fingerprint too.
    copy = tmp_path / "llama-copy"
    shutil.copytree(llama, copy)
    from safetensors.torch import load_file, save_file

    weights = next(copy.glob("*.safetensors"))
    state = load_file(str(weights))
    name = next(iter(state))
    state[name] = state[name] + 1
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(QfdError, match="fingerprint"):
        verify_drafter_target(drafter_dir, copy)


def test_shape_mismatch_is_refused_even_when_allowed(tmp_path, tiny_checkpoints):
    llama = tiny_checkpoints["llama"]
    target_config = json.loads((llama / "config.json").read_text())
    for bad in (dict(vocab_size=VOCAB), dict(hidden_size=HIDDEN, target_hidden_size=HIDDEN), dict(target_layer_ids=(1, 7), num_target_layers=8)):
        cfg = config_for_target(target_config, None, num_layers=1, block_size=4).with_(**bad)
        drafter_dir = _commit_drafter(tmp_path / f"d{len(str(bad))}", llama, cfg)
        with pytest.raises(QfdError, match="does not fit the target"):
            verify_drafter_target(drafter_dir, llama, allow_mismatch=True)
    assert read_drafter_config(drafter_dir).target_layer_ids == (1, 7)
