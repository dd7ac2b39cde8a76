"""Per-token forward KL(teacher || student) over the full vocabulary, in fp32, in sequence
chunks (method.md section 1: QAD loss, temperature 1).

A 248K vocabulary makes [T, V] logits huge, so both heads run per chunk of tokens from the
final hidden states; the student chunk is wrapped in activation checkpointing, so backward
recomputes its logits instead of keeping them: peak extra memory ~ 3 x chunk x V x 4 bytes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


def kl_per_token(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_t || p_s) per row, fp32. [N, V], [N, V] -> [N]."""
    t = torch.log_softmax(teacher_logits.float(), dim=-1)
    s = torch.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1)


def _chunk_kl_sum(student_hidden: torch.Tensor, teacher_logits: torch.Tensor, weight: torch.Tensor, student_head: Callable) -> torch.Tensor:
    return (kl_per_token(teacher_logits, student_head(student_hidden)) * weight).sum()


def chunked_forward_kl(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
    mask: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of per-token KL(teacher || student) over `mask`ed tokens.

    student_hidden / teacher_hidden: [B, T, H] final (normed) hidden states; heads map
    [N, H] -> [N, V]; mask: [B, T] (1 = count the token) or None. Returns (kl_sum, n_tokens):
    the mean is kl_sum / n_tokens; the sum is differentiable w.r.t. the student only."""
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    weight = torch.ones(hs.shape[0], device=hs.device, dtype=torch.float32) if mask is None else mask.reshape(-1).to(hs.device, torch.float32)
    total = hs.new_zeros((), dtype=torch.float32)
    for start in range(0, hs.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        w = weight[sl]
        if not bool(w.any()):
            continue
        with torch.no_grad():
            t_logits = teacher_head(ht[sl].to(hs.device))
        if torch.is_grad_enabled() and hs.requires_grad:
            total = total + checkpoint(_chunk_kl_sum, hs[sl], t_logits, w, student_head, use_reentrant=False)
        else:
            total = total + _chunk_kl_sum(hs[sl], t_logits, w, student_head)
    return total, weight.sum()


def chunked_nll(hidden: torch.Tensor, labels: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], mask: torch.Tensor | None = None, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and count of next-token NLL (fp32). hidden [B, T, H] predicts labels [B, T] (already
    shifted: labels[:, t] is the token after position t); mask [B, T] or None."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    weight = torch.ones_like(y, dtype=torch.float32) if mask is None else mask.reshape(-1).to(h.device, torch.float32)
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        logp = torch.log_softmax(head(h[sl]).float(), dim=-1)
        total = total - (logp.gather(-1, y[sl, None]).squeeze(-1) * weight[sl]).sum()
    return total, weight.sum()
