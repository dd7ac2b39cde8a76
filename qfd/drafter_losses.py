"""DFlash training math (method.md section 2; DFlash, arXiv 2602.06036): the block attention
mask, the position-weighted cross-entropy, and acceptance statistics.

All pure functions on tensors. Notation: a sequence of T tokens, N anchors a_0..a_{N-1}, block
size B. Block n holds B query slots at positions a_n .. a_n + B - 1 (slot 0 = the real token
x[a_n], slots 1..B-1 = MASK); the label of slot k is x[a_n + k].
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None) -> torch.Tensor:
    """Which keys each block query may attend to when all N blocks run in one forward.

    Keys are laid out as [T context features ; N*B block tokens] (block n's tokens at columns
    T + n*B .. T + n*B + B - 1). Query row n*B + k (slot k of block n) sees
      - context column j iff j < a_n (strictly before its anchor) and, with a sliding window W,
        j >= a_n - W (only the last W context tokens);
      - block column T + m*B + l iff m == n (bidirectional inside its own block, no other block).

    anchors: [N] long. Returns bool [N*B, T + N*B] (True = may attend)."""
    n = anchors.numel()
    device = anchors.device
    ctx = torch.arange(ctx_len, device=device)
    anchor = anchors.view(n, 1)
    ctx_visible = ctx.view(1, -1) < anchor  # [N, T]
    if sliding_window is not None:
        ctx_visible &= ctx.view(1, -1) >= anchor - sliding_window
    ctx_visible = ctx_visible.repeat_interleave(block_size, dim=0)  # [N*B, T]
    block_of_row = torch.arange(n * block_size, device=device) // block_size
    same_block = block_of_row.view(-1, 1) == block_of_row.view(1, -1)  # [N*B, N*B]
    return torch.cat([ctx_visible, same_block], dim=1)


def per_block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, sliding_window: int | None = None) -> torch.Tensor:
    """block_attention_mask with the blocks as a batch: block n's queries see keys [T context ;
    its own B tokens] only, so the N x N block-to-block part (all False off the diagonal) is never
    built or computed. Same visibility rule; bool [N, 1, B, T + B] (broadcast over heads)."""
    n = anchors.numel()
    ctx = torch.arange(ctx_len, device=anchors.device).view(1, -1)
    anchor = anchors.view(n, 1)
    ctx_visible = ctx < anchor
    if sliding_window is not None:
        ctx_visible &= ctx >= anchor - sliding_window
    own_block = torch.ones(n, block_size, dtype=torch.bool, device=anchors.device)
    return torch.cat([ctx_visible, own_block], dim=1).view(n, 1, 1, -1).expand(n, 1, block_size, ctx_len + block_size)


def context_window_start(start_pos: int, sliding_window: int | None) -> int:
    """First context position a block starting at `start_pos` attends to (inference path)."""
    if sliding_window is None:
        return 0
    return max(0, start_pos - sliding_window)


def slot_weights(block_size: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for the predicted slots k = 1..B-1; gamma = 7 for B = 16.

    Other block sizes scale gamma with the block (gamma = 7 * (B-1) / 15), keeping the same
    decay over the block. Returns float [B-1]."""
    if gamma is None:
        gamma = 7.0 * (block_size - 1) / 15.0
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of the predicted slots and whether they exist.

    input_ids: [T] long; anchors: [N]. Returns (labels [N, B-1] long, valid [N, B-1] bool): slot k
    of block n is labelled x[a_n + k], invalid past the end of the sequence."""
    offsets = torch.arange(1, block_size, device=anchors.device)
    positions = anchors.view(-1, 1) + offsets.view(1, -1)
    valid = positions < input_ids.numel()
    labels = input_ids[positions.clamp(max=input_ids.numel() - 1)]
    return labels, valid


def weighted_block_ce(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy over predicted slots.

    logits: [N, B-1, V]; labels, valid: [N, B-1]; weights: [B-1].
    Returns (sum_k w_k * CE * valid, sum_k w_k * valid): divide them for the weighted mean (kept
    apart so chunked and accumulated calls combine exactly)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    w = weights.view(1, -1).to(ce.dtype) * valid.to(ce.dtype)
    return (ce * w).sum(), w.sum()


def chunked_weighted_ce(hidden: torch.Tensor, head, labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, chunk_blocks: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """weighted_block_ce of head(hidden) without holding all [N, B-1, V] logits for backward:
    each chunk of blocks recomputes its logits in the backward pass (a 248K vocabulary makes
    full logits for 512 anchors x 15 slots ~ 7.6 GB in fp32).

    hidden: [N, B-1, H] (final norm applied); head: hidden -> logits."""
    from torch.utils.checkpoint import checkpoint

    def piece(h, lab, val):
        return weighted_block_ce(head(h), lab, val, weights)

    total = hidden.new_zeros((), dtype=torch.float32)
    norm = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_blocks):
        sl = slice(start, start + chunk_blocks)
        if hidden.requires_grad:
            loss_sum, weight_sum = checkpoint(piece, hidden[sl], labels[sl], valid[sl], use_reentrant=False)
        else:
            loss_sum, weight_sum = piece(hidden[sl], labels[sl], valid[sl])
        total = total + loss_sum
        norm = norm + weight_sum
    return total, norm


def acceptance_counts(correct: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts for per-position and conditional acceptance.

    correct, valid: [N, B-1] bool (draft at slot k equals its label; the label exists).
    Returns float [B-1] tensors (hits, trials, chain_hits, chain_trials):
      hits/trials: unconditional accuracy at slot k;
      chain_hits/chain_trials: slot k correct given slots 1..k-1 all correct (and k valid)."""
    correct = correct & valid
    prefix_ok = torch.cumprod(correct.to(torch.int64), dim=1).bool()  # slots 1..k all correct
    before_ok = torch.ones_like(prefix_ok)
    before_ok[:, 1:] = prefix_ok[:, :-1]  # slots 1..k-1 all correct
    chain_trials = (before_ok & valid).sum(0).double()
    chain_hits = (prefix_ok & valid).sum(0).double()
    return correct.sum(0).double(), valid.sum(0).double(), chain_hits, chain_trials


def expected_tau(conditional: Sequence[float]) -> float:
    """Tokens committed per step: 1 + sum_k prod_{j<=k} acc_j over the conditional acceptance
    acc_j of the draft positions given (a prefix of them: fewer drafts per step)."""
    tau, all_accepted = 1.0, 1.0
    for a in conditional:
        all_accepted *= a
        tau += all_accepted
    return tau


def acceptance_summary(hits, trials, chain_hits, chain_trials) -> dict:
    """Per-position accuracy, conditional acceptance and the expected acceptance length

        E[tau] = 1 + sum_k prod_{j<=k} acc_j      (acc_j conditional on slots < j accepted)

    i.e. committed tokens per speculative step under greedy verification, bonus token included
    (1 <= E[tau] <= B)."""
    acc = [float(h / t) if t > 0 else 0.0 for h, t in zip(hits.tolist(), trials.tolist())]
    cond = [float(h / t) if t > 0 else 0.0 for h, t in zip(chain_hits.tolist(), chain_trials.tolist())]
    return {
        "expected_acceptance_length": expected_tau(cond),
        "accuracy_per_position": acc,
        "conditional_acceptance_per_position": cond,
        "eval_blocks": int(trials[0].item()) if trials.numel() else 0,
    }


def cosine_lr(step: int, total_steps: int, base_lr: float, warmup_frac: float = 0.04, min_ratio: float = 0.0) -> float:
    """Linear warmup over warmup_frac of the steps, then cosine decay to min_ratio * base_lr."""
    warmup = max(1, int(round(warmup_frac * total_steps)))
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
