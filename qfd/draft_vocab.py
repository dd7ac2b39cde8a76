"""Draft vocabulary: the drafter's LM head over the N most frequent tokens of its training data
(EAGLE-3's reduced draft vocabulary, applied at serving time only; nothing is retrained).

Why: the drafter shares the target's frozen LM head, which it reads at every draft step. For
SmolLM2-135M that is 49152 x 576 float32 (113 MB), ~55% of a drafter step on a 2-core CPU
(docs/benchmarks.md). Logits over W[ids] only, a contiguous [N, H] copy made once, cost N/V
of that. The argmax over the subset is mapped back to a vocabulary id through `ids`.

Lossless: the target verifies every emitted token. Greedy: a draft outside the target's
argmax is rejected and the target's own token is committed, whatever the drafter proposed.
Sampling: the engine's drafter is deterministic (an argmax proposal, q = one-hot at the
draft), so the rejection sampler keeps d with probability p(d) and otherwise resamples from p
with d removed (qfd.speculative.verify_sampling) - exact for any proposal, in or out of the
subset. Where a drafter distribution over the full vocabulary is asked for (`draft(...,
return_logits=True)`), the subset's logits are scattered back with -inf elsewhere, i.e.
q = 0 outside the subset, which the general rejection sampler also handles exactly.

The file: `draft_vocab.safetensors` in a drafter directory (qfd.checkpoint.DRAFT_VOCAB_NAME),
one tensor "token_counts" (int64 [vocab]): how often each id occurs in the response tokens of
the drafter's training data (`qfd draft data` records). `qfd draft train` writes it from its
--data and --extra-data; `qfd draft vocab` adds it to a drafter trained before. A drafter
directory without it stays valid; only `--draft-vocab N` needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from qfd.checkpoint import DRAFT_VOCAB_NAME
from qfd.errors import QfdError
from qfd.models.linear import linear

COUNTS_KEY = "token_counts"
MAKE_ONE = "make one with `qfd draft vocab --drafter D --data DATA --out D2`"


def count_tokens(records: Iterable[dict], vocab_size: int, source: str = "the data") -> torch.Tensor:
    """int64 [vocab_size]: occurrences of each id in the records' `response_ids`. An id outside
    the vocabulary (data of another model) is a QfdError naming `source`."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for record in records:
        ids = record.get("response_ids") or []
        if not ids:
            continue
        ids = torch.as_tensor(ids, dtype=torch.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise QfdError(f"{source} holds token id {hi if hi >= vocab_size else lo}, outside the drafter's vocabulary of {vocab_size}: it was made by a model with another vocabulary")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def top_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent ids (int64 [n]), most frequent first, ties by ascending id: every id
    that occurs comes before every id that does not. n must be in 1..len(counts)."""
    vocab = counts.numel()
    if not 1 <= n <= vocab:
        raise QfdError(f"--draft-vocab must be in 1..{vocab} (the vocabulary size); got {n}")
    order = torch.sort(counts.to(torch.int64).cpu(), descending=True, stable=True).indices  # stable: equal counts keep id order
    return order[:n].clone()


def coverage(counts: torch.Tensor, n: int) -> float:
    """Share of the counted tokens that the top n ids cover (1.0 when nothing was counted)."""
    total = int(counts.sum())
    return float(counts[top_ids(counts, min(n, counts.numel()))].sum()) / total if total else 1.0


def save_counts(counts: torch.Tensor, directory: Path) -> Path:
    from safetensors.torch import save_file

    path = Path(directory) / DRAFT_VOCAB_NAME
    save_file({COUNTS_KEY: counts.to("cpu", torch.int64).contiguous()}, str(path), metadata={"format": "pt"})
    return path


def has_draft_vocab(directory: Path) -> bool:
    return (Path(directory) / DRAFT_VOCAB_NAME).is_file()


def load_counts(directory: Path, vocab_size: int | None = None) -> torch.Tensor | None:
    """The counts of a drafter directory, or None when it has no draft vocabulary."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / DRAFT_VOCAB_NAME
    if not path.is_file():
        return None
    try:
        counts = load_file(str(path)).get(COUNTS_KEY)
    except (SafetensorError, OSError) as exc:
        raise QfdError(f"{path} is not a valid draft vocabulary ({exc}); re-create it with `qfd draft vocab`") from None
    if counts is None or counts.dim() != 1 or counts.dtype != torch.int64:
        raise QfdError(f"{path} is not a draft vocabulary (needs tensor '{COUNTS_KEY}', int64 [vocab]); re-create it with `qfd draft vocab`")
    if vocab_size is not None and counts.numel() != vocab_size:
        raise QfdError(f"{path} counts {counts.numel()} ids, the drafter's vocabulary has {vocab_size}; re-create it with `qfd draft vocab`")
    return counts


def check_draft_vocab(drafter_dir: Path, n: int | None) -> None:
    """Before any loading: `--draft-vocab n` fits the drafter in `drafter_dir` (one QfdError line)."""
    if n is None:
        return
    from qfd.models.drafter_io import read_drafter_config

    vocab = read_drafter_config(drafter_dir).vocab_size
    if not 1 <= n <= vocab:
        raise QfdError(f"--draft-vocab must be in 1..{vocab} (the vocabulary size); got {n}")
    if not has_draft_vocab(drafter_dir):
        raise QfdError(f"drafter {drafter_dir} has no draft vocabulary ({DRAFT_VOCAB_NAME}); {MAKE_ONE}")


def check_draft_vocab_flag(n: int | None, drafter) -> None:
    """Flag-only checks (no files read): a draft vocabulary needs a drafter and n >= 1."""
    if n is None:
        return
    if not drafter:
        raise QfdError("--draft-vocab needs a drafter (--drafter); target-only decoding drafts nothing")
    if n < 1:
        raise QfdError(f"--draft-vocab must be >= 1 (got {n})")


class DraftVocabHead(nn.Module):
    """The LM head restricted to `vocab_ids`: logits [..., N] = hidden @ W[vocab_ids].T (+ bias).

    `weight` is a contiguous copy of those rows, made once; `vocab_ids` (int64 [N]) maps an
    index of these logits back to a vocabulary id (`drafter.draft` and StaticDraftStep do so
    for any head that has `vocab_ids`). Float32 CPU inputs of few rows take the same W @ x.T
    path as qfd.models.linear.Linear."""

    def __init__(self, weight: torch.Tensor, vocab_ids: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.int64, device=weight.device).reshape(-1)
        self.vocab_size = int(weight.shape[0])
        with torch.no_grad():
            self.register_buffer("weight", weight.detach().index_select(0, vocab_ids).contiguous(), persistent=False)
            self.register_buffer("bias", None if bias is None else bias.detach().index_select(0, vocab_ids).contiguous(), persistent=False)
        self.register_buffer("vocab_ids", vocab_ids, persistent=False)

    @classmethod
    def of_target(cls, target, vocab_ids: torch.Tensor) -> "DraftVocabHead":
        """From a runtime target's (or any module's) `lm_head`: dense, or a quantized head
        (`--int4-head`, `--int8-head`), whose rows are taken dequantized in the dtype it computes
        in, so the subset logits are those of the head the target verifies with."""
        from qfd.quant.head import Int8Head
        from qfd.quant.int4_linear import Int4Linear

        head = getattr(target, "lm_head", None)
        if isinstance(head, (Int4Linear, Int8Head)):  # an Int4Linear's `weight`, if any, is only an empty dtype probe
            return cls(head.dequantized_weight(head.dtype), vocab_ids, getattr(head, "bias", None))
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.numel() == 0:
            raise QfdError("--draft-vocab needs the target's dense LM head weight; this target's lm_head has none")
        return cls(weight, vocab_ids, getattr(head, "bias", None))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, self.bias)

    def to_vocab(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into this head's logits -> vocabulary ids (same shape)."""
        return self.vocab_ids[index]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., N] subset logits -> [..., V], -inf outside the subset (softmax: q = 0 there)."""
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.vocab_ids] = logits
        return full


def draft_head_for(target, drafter, n: int | None) -> DraftVocabHead | None:
    """The engine's draft head for `--draft-vocab n` (None: the full head), from the counts
    `load_drafter` attached to the drafter (`drafter.draft_vocab_counts`)."""
    if n is None:
        return None
    if drafter is None:
        raise QfdError("--draft-vocab needs a drafter (--drafter); target-only decoding drafts nothing")
    counts = getattr(drafter, "draft_vocab_counts", None)
    if counts is None:
        where = getattr(drafter, "source_dir", None)
        raise QfdError(f"drafter {where or '(in memory)'} has no draft vocabulary ({DRAFT_VOCAB_NAME}); {MAKE_ONE}")
    vocab = int(target.config.vocab_size)
    if counts.numel() != vocab:
        raise QfdError(f"the drafter's draft vocabulary counts {counts.numel()} ids, the target's vocabulary has {vocab}")
    return DraftVocabHead.of_target(target, top_ids(counts, n))


def data_counts(data_dirs: Sequence[Path], vocab_size: int) -> tuple[torch.Tensor, int]:
    """(counts, records) over the response tokens of `qfd draft data` directories."""
    from qfd.data import load_data_dir

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    n_records = 0
    for directory in data_dirs:
        records, _ = load_data_dir(directory)
        counts += count_tokens(records, vocab_size, source=f"--data {directory}")
        n_records += len(records)
    return counts, n_records
