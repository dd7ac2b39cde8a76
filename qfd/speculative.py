"""Pure verification math for speculative decoding (method.md section 4).

Greedy: accept the longest prefix of the draft that equals the target's argmax, then commit the
target's own token at the first mismatch (the bonus token), so the output equals target-only
greedy decoding token for token.

Sampling: the standard rejection sampler (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023): draft token d drawn
from the drafter's q is kept with probability min(1, p(d) / q(d)); at the first rejection the
token is resampled from norm(max(p - q, 0)); if every draft survives, a bonus token is drawn
from p at the position after the block. A deterministic drafter (DFlash proposes argmax
tokens) is the one-hot case q = e_d: keep d with probability p(d), else sample from p with d
removed. Either way every committed token follows the target distribution exactly.

`target_probs` turns logits into the distribution both target-only sampling and verification
use (temperature, then top-k, then top-p), so both paths sample the very same p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k, top-p.

    top-k keeps the k largest logits; top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (the most likely token always stays). Greedy
    (temperature 0) gives the one-hot distribution of the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # mass BEFORE the token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [..., V] -> token ids [...] (one multinomial draw per row)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one block. accepted: draft tokens kept (0..B-1); tokens: the
    committed ids = accepted drafts + the bonus/resampled token (length accepted + 1)."""

    accepted: int
    tokens: list[int]


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """draft [B-1] proposed ids; target_logits [B, V]: row i is the target's prediction after
    the block's first i+1 tokens (row 0 follows the last committed token). Accept the longest
    prefix with draft[i] == argmax(row i); the bonus token is the argmax of the next row."""
    choice = target_logits.argmax(-1)  # [B]
    return verify_greedy_choices(draft, choice)


def verify_greedy_choices(draft: torch.Tensor, choice: torch.Tensor) -> Verdict:
    """As verify_greedy with the target's argmax ids `choice` [B] already computed."""
    n_draft = draft.shape[0]
    match = (draft == choice[:n_draft]).long()
    # length of the leading run of matches: cumprod zeroes everything after the first mismatch
    accepted = int(match.cumprod(0).sum()) if n_draft else 0
    tokens = choice[: accepted + 1].tolist()
    return Verdict(accepted, tokens)


def verify_sampling(draft: torch.Tensor, target_p: torch.Tensor, draft_q: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Verdict:
    """Rejection sampling over one block.

    draft [B-1] proposed ids; target_p [B, V] target probabilities (from `target_probs`) at the
    block's positions (row i follows block token i); draft_q [B-1, V] the drafter's proposal
    distributions, or None for a deterministic drafter (one-hot at the draft ids).
    Returns the committed tokens: the accepted drafts, then either the token resampled at the
    first rejection or, when all are accepted, a bonus drawn from the last row."""
    n_draft = draft.shape[0]
    device = target_p.device
    rows = torch.arange(n_draft, device=device)
    p_d = target_p[rows, draft]  # [B-1]
    q_d = torch.ones_like(p_d) if draft_q is None else draft_q[rows, draft].float()
    u = torch.rand(n_draft, generator=generator, device=device) if n_draft else p_d
    # accept d with probability min(1, p(d)/q(d)): u * q < p  (u in [0, 1))
    keep = (u * q_d < p_d).long()
    accepted = int(keep.cumprod(0).sum()) if n_draft else 0
    tokens = draft[:accepted].tolist()
    if accepted < n_draft:
        p = target_p[accepted]
        if draft_q is None:
            residual = p.clone()
            residual[draft[accepted]] = 0.0
        else:
            residual = (p - draft_q[accepted].float()).clamp_min(0.0)
        total = residual.sum()
        # p == q up to rounding (cannot happen after a genuine rejection, but stay safe)
        residual = residual / total if total > 0 else p
        tokens.append(int(sample(residual, generator)))
    else:
        tokens.append(int(sample(target_p[n_draft], generator)))
    return Verdict(accepted, tokens)


def verify(draft: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams, draft_q: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Verdict:
    """Greedy or rejection-sampled verification of one block (see the two functions above)."""
    if params.greedy:
        return verify_greedy(draft, target_logits)
    return verify_sampling(draft, target_probs(target_logits, params), draft_q, generator)
