"""QAD training on the original INT4 grid (method.md section 1).

The student is a dense transformers model whose quantized linears become FakeQuantLinear:
latent fp32 weights initialised to the dequantized INT4 values (exactly on the grid), frozen
per-group scales / zero points, forward w_hat = fake_quant(latent), clipped STE backward. Only
the latents train; loss = per-token KL(teacher || student) in fp32 from chunked heads.
AdamW (weight decay 0), warmup + cosine, gradient clipping, resumable state. Under torchrun
(`dist`, qfd.distributed) each rank takes every W-th row of a step's batch and the gradients are
summed over ranks before clipping: the same run as one process, W times fewer rows each.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from qfd.distributed import Dist
from qfd.losses import chunked_forward_kl, chunked_nll
from qfd.quant.grid import fake_quant, requantize
from qfd.quant.types import QuantizedWeight


class FakeQuantLinear(nn.Module):
    """nn.Linear replacement: y = x @ fake_quant(weight).T + b. `weight` [out, in] fp32 is the
    trainable latent; `scales`/`zeros` [out, in/g] are frozen buffers (fp32 copies of the
    checkpoint's exact values)."""

    def __init__(self, weight: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.float32).clone())
        self.register_buffer("scales", qw.scales.detach().to(device=weight.device, dtype=torch.float32))
        self.register_buffer("zeros", None if qw.zeros is None else qw.zeros.detach().to(device=weight.device, dtype=torch.float32))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.group_size, self.bits = qw.group_size, qw.bits

    def quantized_weight(self) -> torch.Tensor:
        return fake_quant(self.weight, self.scales, self.zeros, self.group_size, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quantized_weight()
        return nn.functional.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def attach_fake_quant(model: nn.Module, qweights: dict[str, QuantizedWeight]) -> dict[str, nn.Parameter]:
    """Swap every linear named in `qweights` for a FakeQuantLinear initialised from that
    linear's (dequantized) weight; freeze every other parameter. Returns path -> latent."""
    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(model.named_modules())
    latents = {}
    for path, qw in qweights.items():
        old = modules[path]
        new = FakeQuantLinear(old.weight, qw, getattr(old, "bias", None))
        parent, _, name = path.rpartition(".")
        setattr(modules[parent] if parent else model, name, new)
        latents[path] = new.weight
    return latents


def repack_codes(model: nn.Module, qweights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """Round every latent onto its frozen grid: new codes, the SAME scale/zero tensors."""
    modules = dict(model.named_modules())
    return {path: requantize(qw, modules[path].weight.detach().cpu()) for path, qw in qweights.items()}


def hidden_and_head(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, Callable]:
    """Final (normed) hidden states [B, T, H] and the LM head of a transformers causal LM."""
    out = model.base_model(input_ids=input_ids, use_cache=False)
    return out.last_hidden_state, model.get_output_embeddings()


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warmup over `warmup` steps, then cosine to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrainSettings:
    steps: int
    lr: float
    batch_size: int
    grad_accum: int
    warmup_fraction: float = 0.03
    clip: float = 1.0
    kl_chunk: int = 1024
    eval_every: int = 50
    save_every: int = 25
    seed: int = 0
    autocast_dtype: torch.dtype | None = None  # bf16 on CUDA: latents stay fp32


class Evaluator:
    """Held-out KL(teacher || model) and model perplexity; the teacher's hidden states of the
    held-out blocks are computed once and reused (they do not change)."""

    def __init__(self, teacher: nn.Module, blocks: torch.Tensor, device: torch.device, kl_chunk: int, autocast_dtype=None):
        self.blocks, self.device, self.kl_chunk, self.autocast_dtype = blocks, device, kl_chunk, autocast_dtype
        self.teacher_head = teacher.get_output_embeddings()
        with torch.no_grad(), self._autocast():
            self.teacher_hidden = [hidden_and_head(teacher, blocks[i : i + 1].to(device))[0] for i in range(blocks.shape[0])]

    def _autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast("cpu", enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        kl_sum = nll_sum = tokens = 0.0
        for i in range(self.blocks.shape[0]):
            ids = self.blocks[i : i + 1].to(self.device)
            with self._autocast():
                hidden, head = hidden_and_head(model, ids)
                kl, n = chunked_forward_kl(hidden, self.teacher_hidden[i], head, self.teacher_head, chunk_size=self.kl_chunk)
                nll, m = chunked_nll(hidden[:, :-1], ids[:, 1:], head, chunk_size=self.kl_chunk)
            kl_sum += float(kl)
            nll_sum += float(nll)
            tokens += float(n)
        model.train(was_training)
        n_pred = tokens - self.blocks.shape[0]
        return {"kl": kl_sum / tokens, "ppl": math.exp(nll_sum / max(1.0, n_pred))}


class QadTrainer:
    """Runs the QAD loop with resumable state in `state_dir/train_state.pt`. With a multi-rank
    `dist` every rank builds the same trainer; rank 0 alone evaluates (others may pass
    evaluator=None) and saves the state."""

    def __init__(self, student: nn.Module, teacher: nn.Module, latents: dict[str, nn.Parameter], train_blocks: torch.Tensor, evaluator: Evaluator | None, settings: TrainSettings, state_dir: Path, device: torch.device, dist: Dist | None = None):
        self.dist = dist if dist is not None else Dist()
        self.student, self.teacher, self.latents = student, teacher, latents
        self.train_blocks, self.evaluator, self.s, self.device = train_blocks, evaluator, settings, device
        self.state_path = Path(state_dir) / "train_state.pt"
        self.optimizer = torch.optim.AdamW(list(latents.values()), lr=settings.lr, weight_decay=0.0)
        # The schedule is fixed at construction: a run stopped early (run(until=...)) and resumed
        # follows the same learning rates as an uninterrupted one.
        total, warmup = settings.steps, max(1, round(settings.warmup_fraction * settings.steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: warmup_cosine(step, total, warmup))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.teacher_head = teacher.get_output_embeddings()

    # --- state -----------------------------------------------------------------------
    def save_state(self) -> None:
        state = {
            "step": self.step,
            "latents": {k: v.detach().cpu() for k, v in self.latents.items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "history": self.history,
        }
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def load_state(self) -> bool:
        if not self.state_path.is_file():
            return False
        state = torch.load(self.state_path, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for name, tensor in state["latents"].items():
                self.latents[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.history = state["step"], state["history"]
        return True

    # --- training --------------------------------------------------------------------
    def _autocast(self):
        if self.s.autocast_dtype is None:
            return torch.autocast("cpu", enabled=False)
        return torch.autocast(self.device.type, dtype=self.s.autocast_dtype)

    def batch_indices(self, step: int) -> torch.Tensor:
        """Block indices of one optimizer step: a function of (seed, step), so a resumed run
        sees the same data as an uninterrupted one."""
        generator = torch.Generator().manual_seed(self.s.seed * 1_000_003 + step)
        return torch.randint(0, self.train_blocks.shape[0], (self.s.grad_accum, self.s.batch_size), generator=generator)

    def train_step(self) -> float:
        self.student.train()
        self.optimizer.zero_grad(set_to_none=True)
        kl_total, token_total = 0.0, 0.0
        micro = self.batch_indices(self.step)
        n_tokens = float(micro.numel() * self.train_blocks.shape[1])
        # This rank's rows of the step (all of them in one process), at most batch_size a forward.
        rows = torch.tensor(self.dist.shard(micro.flatten().tolist()), dtype=torch.long)
        for indices in rows.split(self.s.batch_size) if rows.numel() else ():
            ids = self.train_blocks[indices].to(self.device)
            with torch.no_grad(), self._autocast():
                t_hidden, _ = hidden_and_head(self.teacher, ids)
            with self._autocast():
                s_hidden, s_head = hidden_and_head(self.student, ids)
                kl_sum, count = chunked_forward_kl(s_hidden, t_hidden, s_head, self.teacher_head, chunk_size=self.s.kl_chunk)
            (kl_sum / n_tokens).backward()  # mean over all tokens of the step
            kl_total += float(kl_sum.detach())
            token_total += float(count)
        self.dist.all_reduce_grads(list(self.latents.values()))
        kl_total, token_total = self.dist.all_reduce_scalar(kl_total), self.dist.all_reduce_scalar(token_total)
        torch.nn.utils.clip_grad_norm_(list(self.latents.values()), self.s.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return kl_total / token_total

    def run(self, on_step: Callable[[int, float, dict | None], None] | None = None, until: int | None = None) -> list[dict[str, Any]]:
        """Train to `settings.steps` (or stop after step `until`, as an interrupted run would)."""
        last = self.s.steps if until is None else min(until, self.s.steps)
        while self.step < last:
            kl = self.train_step()
            record: dict[str, Any] = {"step": self.step, "train_kl": kl, "lr": self.scheduler.get_last_lr()[0]}
            evaluated = None
            if self.dist.is_main and self.s.eval_every and (self.step % self.s.eval_every == 0 or self.step == self.s.steps):
                evaluated = self.evaluator(self.student)
                record.update({"eval_kl": evaluated["kl"], "eval_ppl": evaluated["ppl"]})
            self.history.append(record)
            if self.dist.is_main and (self.step % self.s.save_every == 0 or self.step == self.s.steps):
                self.save_state()
            if on_step is not None:
                on_step(self.step, kl, evaluated)
        return self.history
