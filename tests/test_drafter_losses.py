"""DFlash training math: the block mask against its definition, slot weights, acceptance."""

from __future__ import annotations

import math

import pytest
import torch

from qfd.drafter_losses import (
    acceptance_counts,
    acceptance_summary,
    block_attention_mask,
    block_labels,
    chunked_weighted_ce,
    per_block_attention_mask,
    cosine_lr,
    slot_weights,
    weighted_block_ce,
)


def brute_force_mask(anchors: list[int], ctx_len: int, block: int, window: int | None) -> torch.Tensor:
    """Row-by-row from the definition (method.md section 2)."""
    n = len(anchors)
    mask = torch.zeros(n * block, ctx_len + n * block, dtype=torch.bool)
    for b, a in enumerate(anchors):
        for k in range(block):
            row = b * block + k
            for j in range(ctx_len):  # context strictly before the anchor (last W with a window)
                mask[row, j] = j < a and (window is None or j >= a - window)
            for m in range(n):  # bidirectional inside its own block, no other block
                for slot in range(block):
                    mask[row, ctx_len + m * block + slot] = m == b
    return mask


@pytest.mark.parametrize("window", [None, 1, 3, 100])
def test_block_mask_matches_definition(window):
    anchors = [0, 2, 5, 9, 9]
    got = block_attention_mask(torch.tensor(anchors), 12, 4, window)
    assert torch.equal(got, brute_force_mask(anchors, 12, 4, window))


@pytest.mark.parametrize("window", [None, 1, 3, 100])
def test_per_block_mask_is_the_block_mask_without_cross_block_columns(window):
    anchors, ctx, block = [0, 2, 5, 9, 9], 12, 4
    full = brute_force_mask(anchors, ctx, block, window)
    got = per_block_attention_mask(torch.tensor(anchors), ctx, block, window)
    assert got.shape == (len(anchors), 1, block, ctx + block)
    for b in range(len(anchors)):
        rows = full[b * block : (b + 1) * block]
        own = rows[:, ctx + b * block : ctx + (b + 1) * block]
        assert torch.equal(got[b, 0], torch.cat([rows[:, :ctx], own], dim=1))


def test_block_mask_window_at_least_context_is_full():
    anchors = torch.tensor([3, 7, 11])
    assert torch.equal(block_attention_mask(anchors, 12, 4, 12), block_attention_mask(anchors, 12, 4, None))
    assert not torch.equal(block_attention_mask(anchors, 12, 4, 2), block_attention_mask(anchors, 12, 4, None))


def test_slot_weights_paper_values():
    w = slot_weights(16)
    assert w.shape == (15,)
    assert w[0].item() == 1.0
    for k in range(1, 16):
        assert w[k - 1].item() == pytest.approx(math.exp(-(k - 1) / 7.0))
    assert torch.all(w[1:] < w[:-1])


def test_block_labels_and_validity():
    ids = torch.arange(100, 110)  # T = 10
    labels, valid = block_labels(ids, torch.tensor([2, 7]), 4)
    assert labels[0].tolist() == [103, 104, 105]
    assert valid[0].all()
    assert valid[1].tolist() == [True, True, False]  # 8, 9 exist; 10 is past the end
    assert labels[1, :2].tolist() == [108, 109]


def test_weighted_ce_is_weighted_mean_over_valid_slots():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 11)
    labels = torch.randint(0, 11, (3, 4))
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    w = slot_weights(5)
    total, norm = weighted_block_ce(logits, labels, valid, w)
    expected_num, expected_den = 0.0, 0.0
    for n in range(3):
        for k in range(4):
            if valid[n, k]:
                ce = -torch.log_softmax(logits[n, k], -1)[labels[n, k]].item()
                expected_num += w[k].item() * ce
                expected_den += w[k].item()
    assert total.item() == pytest.approx(expected_num, rel=1e-5)
    assert norm.item() == pytest.approx(expected_den, rel=1e-6)


def test_chunked_ce_equals_unchunked_with_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 13, bias=False)
    hidden = torch.randn(7, 3, 8, requires_grad=True)
    labels = torch.randint(0, 13, (7, 3))
    valid = torch.rand(7, 3) > 0.2
    w = slot_weights(4)
    full, norm_full = weighted_block_ce(head(hidden), labels, valid, w)
    (g_full,) = torch.autograd.grad(full, hidden)
    chunked, norm_chunked = chunked_weighted_ce(hidden, head, labels, valid, w, chunk_blocks=2)
    (g_chunked,) = torch.autograd.grad(chunked, hidden)
    assert chunked.item() == pytest.approx(full.item(), rel=1e-5)
    assert norm_chunked.item() == pytest.approx(norm_full.item())
    assert torch.allclose(g_full, g_chunked, atol=1e-6)


def test_expected_acceptance_length_from_conditional_acceptance():
    # Four blocks of 3 drafts: accepted prefix lengths 3, 1, 0, 2 -> E[tau] = 1 + mean = 2.5
    correct = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    valid = torch.ones_like(correct)
    summary = acceptance_summary(*acceptance_counts(correct, valid))
    assert summary["expected_acceptance_length"] == pytest.approx(2.5)
    assert summary["accuracy_per_position"] == pytest.approx([0.75, 0.75, 0.75])
    assert summary["conditional_acceptance_per_position"] == pytest.approx([0.75, 2 / 3, 0.5])
    perfect = acceptance_summary(*acceptance_counts(torch.ones(5, 15, dtype=torch.bool), torch.ones(5, 15, dtype=torch.bool)))
    assert perfect["expected_acceptance_length"] == 16.0
    never = acceptance_summary(*acceptance_counts(torch.zeros(5, 15, dtype=torch.bool), torch.ones(5, 15, dtype=torch.bool)))
    assert never["expected_acceptance_length"] == 1.0


def test_cosine_schedule_warmup_and_decay():
    lrs = [cosine_lr(s, 100, 1e-3, 0.04) for s in range(100)]
    assert lrs[0] == pytest.approx(2.5e-4) and lrs[3] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[-1] < 1e-5
