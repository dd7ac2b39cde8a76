"""Online, teacher-forced DFlash training (method.md section 2; DFlash, arXiv 2602.06036).

Per sequence (prompt + target-generated response): the frozen target runs once and its tapped
hidden states become the drafter's context; up to `max_anchors` random anchors in the response
region each start a block [x[a], MASK x (B-1)]; the blocks go through the drafter as a batch,
each seeing its sequence's context before its anchor and its own block (the block mask); the
sequences of a step share one target pass and as few drafter passes as memory allows;
loss = CE weighted by exp(-(k-1)/gamma). AdamW, linear warmup + cosine, gradient clipping, gradient accumulation over sequences, bf16 autocast on CUDA. The
loop checkpoints its full state into the staging state dir and resumes from it. Under torchrun
(`dist`, qfd.distributed) each rank takes every W-th sequence of a step and the gradients are
summed over ranks before clipping: the same run as one process, W times fewer sequences each.

Evaluation on held-out sequences: per-position accuracy and the expected acceptance length
E[tau] = 1 + sum_k prod_{j<=k} acc_j, labels = the held-out target-generated tokens.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from qfd.drafter_losses import (
    acceptance_counts,
    acceptance_summary,
    block_labels,
    chunked_weighted_ce,
    cosine_lr,
    slot_weights,
    weighted_block_ce,
)
from qfd.distributed import Dist

STATE_FILE = "train_state.pt"


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    grad_accum: int = 4
    max_anchors: int = 512
    max_len: int = 3072
    epochs: float = 1.0
    steps: int | None = None  # optimizer steps; None: epochs over the training sequences
    gamma: float | None = None  # None: 7 for B = 16 (scaled with B)
    seed: int = 0
    pack_tokens: int = 8192  # sequences of a step share one target pass up to this many padded tokens
    max_cells: int | None = None  # blocks x context positions per drafter pass; None: default_max_cells
    eval_anchors: int = 128  # per held-out sequence
    max_minutes: float | None = None  # stop early (schedule unchanged) after this much time
    checkpoint_every_s: float = 120.0
    log_every: int = 10


@dataclass
class TrainSequence:
    """One training sequence: token ids [T] and where its response starts."""

    ids: torch.Tensor
    prompt_len: int


def prepare_sequences(records: Sequence[dict], max_len: int) -> list[TrainSequence]:
    """Records -> sequences truncated to max_len; those with < 2 response tokens left (no
    anchor with a label) are dropped."""
    out = []
    for record in records:
        ids = list(record["prompt_ids"]) + list(record["response_ids"])
        ids = ids[:max_len]
        prompt_len = len(record["prompt_ids"])
        if len(ids) - prompt_len >= 2:
            out.append(TrainSequence(torch.tensor(ids, dtype=torch.long), prompt_len))
    return out


def split_holdout(records: Sequence[dict], fraction: float, max_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """A deterministic held-out split (at least 1 record when there are >= 2)."""
    n = len(records)
    n_eval = 0 if n < 2 else max(1, min(max_eval, int(round(fraction * n))))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 17)).tolist()
    held = set(order[:n_eval])
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def sample_anchors(prompt_len: int, total_len: int, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Anchors in the response region [prompt_len, total_len - 2] (each has >= 1 label), at most
    max_anchors, drawn without replacement, sorted. At inference the first block starts at the
    first generated token, so the response's first token is slot 0, never a draft."""
    candidates = total_len - 1 - prompt_len
    if candidates <= max_anchors:
        return torch.arange(prompt_len, total_len - 1)
    pick = torch.randperm(candidates, generator=generator)[:max_anchors]
    return torch.sort(pick + prompt_len).values


class FrozenTarget:
    """The target as the drafter sees it: taps, embedding and head, all frozen (a transformers
    causal LM; taps = hidden_states[i + 1] of the tap layers, concatenated)."""

    def __init__(self, model, tap_layers: Sequence[int]):
        self.model = model
        self.tap_layers = tuple(tap_layers)
        for p in model.parameters():
            p.requires_grad_(False)
        self.embed = model.get_input_embeddings()
        self.head_module = model.get_output_embeddings()
        weight = getattr(self.head_module, "weight", None)
        self.head_dtype = weight.dtype if weight is not None else None
        self.device = next(model.parameters()).device

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head (final norm not applied: the drafter has its own)."""
        return self.head_module(hidden.to(self.head_dtype) if self.head_dtype is not None else hidden)

    @torch.no_grad()
    def taps(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] or [G, T] (right-padded rows) -> taps [1 or G, T, k*H]."""
        ids = ids.view(-1, ids.shape[-1]).to(self.device)
        out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        return torch.cat([out.hidden_states[i + 1] for i in self.tap_layers], dim=-1)


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def sequence_loss(drafter, target: FrozenTarget, seq: TrainSequence, anchors: torch.Tensor, weights: torch.Tensor):
    """(weighted CE sum, weight sum) of one sequence's blocks at `anchors`, all blocks in one
    forward under the dense block mask: the reference the packed path is tested against (and
    the profiler's one-by-one baseline); training runs packed_loss_backward."""
    device = target.device
    ids = seq.ids.to(device)
    anchors = anchors.to(device)
    taps = target.taps(ids)
    with _autocast(device):
        hidden = drafter.forward_train(taps, ids, anchors, target.embed)
        labels, valid = block_labels(ids, anchors, drafter.block_size)
        return chunked_weighted_ce(hidden, target.head, labels, valid, weights.to(device))


@dataclass
class Pack:
    """Several sequences' blocks for one drafter pass: right-padded ids [G, T], each block's
    sequence and anchor [N], and the labels [N, B-1] with their validity."""

    ids: torch.Tensor
    block_seq: torch.Tensor
    anchors: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor


def make_pack(seqs: Sequence[TrainSequence], anchors: Sequence[torch.Tensor], block_size: int, device) -> Pack:
    width = max(s.ids.numel() for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels, valid = [], []
    for g, (seq, a) in enumerate(zip(seqs, anchors)):
        ids[g, : seq.ids.numel()] = seq.ids
        lab, val = block_labels(seq.ids, a, block_size)  # each sequence's own end, not the padding
        labels.append(lab)
        valid.append(val)
    block_seq = torch.cat([torch.full((a.numel(),), g, dtype=torch.long) for g, a in enumerate(anchors)])
    return Pack(ids.to(device), block_seq.to(device), torch.cat(list(anchors)).to(device), torch.cat(labels).to(device), torch.cat(valid).to(device))


def pack_groups(parts: Sequence[tuple[TrainSequence, torch.Tensor]], max_tokens: int) -> list[list[tuple[TrainSequence, torch.Tensor]]]:
    """Consecutive (sequence, anchors) parts grouped so each group's padded target batch holds
    at most max_tokens (a longer sequence is a group of its own)."""
    groups, current, width = [], [], 0
    for part in parts:
        new_width = max(width, part[0].ids.numel())
        if current and new_width * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, new_width = [], part[0].ids.numel()
        current.append(part)
        width = new_width
    if current:
        groups.append(current)
    return groups


GATHERED_KV_BYTES = 1 << 30  # per K (and per V) tensor of one drafter layer in one pass


def default_max_cells(drafter_cfg) -> int:
    """Block x context cells whose gathered, head-expanded bf16 K fits GATHERED_KV_BYTES: ~930K
    at SmolLM2's drafter width (9 x 64), ~131K at Qwen3.5-4B's (32 x 128), where a 3072-token
    sequence's 512 blocks then go through in 12 passes instead of one that would not fit."""
    return GATHERED_KV_BYTES // (drafter_cfg.num_attention_heads * drafter_cfg.head_dim * 2)


def block_chunks(pack: Pack, max_cells: int) -> list[slice]:
    """Slices of the pack's blocks, each with at most max_cells block x context cells (the
    gathered context keys of a chunk are [blocks, heads, T, d]: this bounds their memory)."""
    per_chunk = max(1, max_cells // pack.ids.shape[1])
    n = pack.anchors.numel()
    return [slice(i, min(n, i + per_chunk)) for i in range(0, n, per_chunk)]


def block_passes(drafter, target: FrozenTarget, parts: Sequence[tuple[TrainSequence, torch.Tensor]], pack_tokens: int, max_cells: int | None = None):
    """The drafter passes over all blocks of (sequence, anchors) parts: sequences grouped into
    one target pass each (pack_groups), each group's blocks in chunks of at most max_cells
    (default_max_cells). Yields (hidden [n, B-1, H], labels [n, B-1], valid [n, B-1]); a
    training consumer back-propagates each before taking the next, so one chunk's activations
    are alive at a time."""
    max_cells = max_cells or default_max_cells(drafter.cfg)
    for group in pack_groups(parts, pack_tokens):
        pack = make_pack([s for s, _ in group], [a for _, a in group], drafter.block_size, target.device)
        taps = target.taps(pack.ids)
        for chunk in block_chunks(pack, max_cells):
            with _autocast(target.device):
                hidden = drafter.forward_blocks(taps, pack.ids, pack.block_seq[chunk], pack.anchors[chunk], target.embed)
            yield hidden, pack.labels[chunk], pack.valid[chunk]


def packed_loss_backward(drafter, target: FrozenTarget, parts: Sequence[tuple[TrainSequence, torch.Tensor]], weights: torch.Tensor, norm: float, pack_tokens: int, max_cells: int | None = None) -> float:
    """Weighted CE of all blocks of `parts` divided by `norm`, back-propagated pass by pass;
    returns the loss value."""
    weights = weights.to(target.device)
    total = 0.0
    for hidden, labels, valid in block_passes(drafter, target, parts, pack_tokens, max_cells):
        with _autocast(target.device):
            loss_sum, _ = chunked_weighted_ce(hidden, target.head, labels, valid, weights)
        (loss_sum / norm).backward()
        total += float(loss_sum.detach()) / norm
    return total


@torch.no_grad()
def evaluate(drafter, target: FrozenTarget, sequences: Sequence[TrainSequence], max_anchors: int = 128, seed: int = 0, gamma: float | None = None, pack_tokens: int = 8192, max_cells: int | None = None) -> dict:
    """Held-out loss, per-position accuracy and expected acceptance length (see
    qfd.drafter_losses.acceptance_summary). Anchors are drawn with a fixed seed, so two
    drafters evaluated on the same sequences see the same blocks."""
    was_training = drafter.training
    drafter.eval()
    bsz = drafter.block_size
    weights = slot_weights(bsz, gamma).to(target.device)
    generator = torch.Generator().manual_seed(seed + 99)
    totals = [torch.zeros(bsz - 1, dtype=torch.float64) for _ in range(4)]
    loss_sum, weight_sum = 0.0, 0.0
    parts = [(seq, sample_anchors(seq.prompt_len, seq.ids.numel(), max_anchors, generator)) for seq in sequences]
    for hidden, labels, valid in block_passes(drafter, target, parts, pack_tokens, max_cells):
        for start in range(0, hidden.shape[0], 64):  # logits of 64 blocks at a time
            sl = slice(start, start + 64)
            with _autocast(target.device):
                logits = target.head(hidden[sl])
            ls, ws = weighted_block_ce(logits, labels[sl], valid[sl], weights)
            loss_sum, weight_sum = loss_sum + float(ls), weight_sum + float(ws)
            for total, part in zip(totals, acceptance_counts(logits.argmax(-1) == labels[sl], valid[sl])):
                total += part.cpu()
    drafter.train(was_training)
    summary = acceptance_summary(*totals)
    summary["loss"] = loss_sum / weight_sum if weight_sum else float("nan")
    summary["eval_sequences"] = len(sequences)
    return summary


def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_drafter(drafter, target: FrozenTarget, train: Sequence[TrainSequence], cfg: TrainConfig, state_dir: Path | None = None, log_path: Path | None = None, progress: bool = True, dist: Dist | None = None) -> dict:
    """Train `drafter` in place; returns training metrics. Resumes from `state_dir` if it holds
    a checkpoint of the same run (same config and data size). With a multi-rank `dist`, every
    rank calls this with the same arguments; only rank 0 writes the state and the log."""
    if not train:
        raise ValueError("no training sequences")
    dist = dist if dist is not None else Dist()
    if dist.is_main and cfg.grad_accum < dist.world:
        from qfd.console import console

        console.print(f"[bold yellow]warning:[/bold yellow] --grad-accum {cfg.grad_accum} < {dist.world} ranks: {dist.world - cfg.grad_accum} ranks idle (each step has grad_accum sequences)")
    device = target.device
    drafter.to(device).train()
    per_epoch = math.ceil(len(train) / cfg.grad_accum)
    total_steps = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * per_epoch))
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    weights = slot_weights(drafter.block_size, cfg.gamma)
    # What must match for a checkpoint to be resumed (not: how often it checkpoints or logs).
    same_run = {k: v for k, v in asdict(cfg).items() if k not in ("checkpoint_every_s", "max_minutes", "log_every")}
    run_key = {"config": same_run, "sequences": len(train), "drafter": repr(drafter.cfg)}
    step, elapsed_before, history = 0, 0.0, []
    state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
    if state_path is not None and state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state.get("run_key") == run_key:
            drafter.load_state_dict(state["drafter"])
            optimizer.load_state_dict(state["optimizer"])
            step, elapsed_before, history = state["step"], state["elapsed_s"], state["history"]
            from qfd.console import console

            console.print(f"[dim]resuming drafter training at step {step}/{total_steps}[/dim]")

    def sequence_at(i: int) -> TrainSequence:
        epoch, pos = divmod(i, len(train))
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
        return train[int(order[pos])]

    started, last_save = time.monotonic(), time.monotonic()
    stopped_early = False
    from qfd.console import progress_bar

    writes = dist.is_main  # other ranks hold the same parameters: rank 0 alone saves them
    log = open(log_path, "a") if log_path is not None and writes else None
    try:
        with progress_bar() as bar:
            task = bar.add_task("training drafter", total=total_steps, completed=step, visible=progress and writes)
            while step < total_steps:
                # this invocation's time: a continued run gets its own --max-minutes
                if cfg.max_minutes is not None and time.monotonic() - started > 60 * cfg.max_minutes:
                    stopped_early = True
                if cfg.max_minutes is not None and dist.world > 1:  # every rank stops at the same step
                    stopped_early = dist.all_reduce_scalar(stopped_early) > 0
                if stopped_early:
                    break
                lr = cosine_lr(step, total_steps, cfg.lr, cfg.warmup_frac)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.zero_grad(set_to_none=True)
                # Per-step generator: anchors are reproducible after a resume.
                generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
                parts = []
                for micro in range(cfg.grad_accum):
                    seq = sequence_at(step * cfg.grad_accum + micro)
                    anchors = sample_anchors(seq.prompt_len, seq.ids.numel(), cfg.max_anchors, generator)
                    parts.append((seq, anchors))
                # Normalise by the step's total weight: the weighted mean over all valid slots.
                norm = sum(float(block_labels(s.ids, a, drafter.block_size)[1].float().mul(weights).sum()) for s, a in parts)
                # this rank's sequences of the step
                loss_value = packed_loss_backward(drafter, target, dist.shard(parts), weights, norm, cfg.pack_tokens, cfg.max_cells)
                dist.all_reduce_grads(params)
                loss_value = dist.all_reduce_scalar(loss_value)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip))
                optimizer.step()
                step += 1
                history.append({"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm})
                if log is not None and (step % cfg.log_every == 0 or step == total_steps):
                    log.write(json.dumps(history[-1]) + "\n")
                    log.flush()
                bar.update(task, advance=1, postfix=f"loss={loss_value:.3f} lr={lr:.2e}")
                if writes and state_path is not None and time.monotonic() - last_save > cfg.checkpoint_every_s:
                    _save_state(state_path, {"run_key": run_key, "drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "elapsed_s": elapsed_before + time.monotonic() - started, "history": history})
                    last_save = time.monotonic()
    finally:
        if log is not None:
            log.close()
    elapsed = elapsed_before + time.monotonic() - started
    if writes and state_path is not None:
        _save_state(state_path, {"run_key": run_key, "drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "elapsed_s": elapsed, "history": history})
    recent = [h["loss"] for h in history[-max(1, min(20, len(history))):]]
    return {
        "steps": step,
        "total_steps": total_steps,
        "stopped_early": stopped_early,
        "train_seconds": elapsed,
        "train_sequences": len(train),
        "final_train_loss": sum(recent) / len(recent) if recent else float("nan"),
        "history": history,
    }
