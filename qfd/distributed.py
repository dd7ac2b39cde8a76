"""Data-parallel training under `torchrun` (torch.distributed: nccl on CUDA, gloo on CPU).

Every rank holds the whole model. An optimizer step's micro-batches are dealt round-robin
(rank r gets items r, r+W, r+2W, ...), each rank backpropagates its share of the step's
globally normalised loss, and `all_reduce_grads` sums the gradients before clipping and the
optimizer step: all ranks keep identical parameters and the run equals the single-process
one up to float summation order. Rank 0 alone writes files and talks; `on_main` runs a piece
of work there and hands its result (or its exception) to every rank.
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as tdist

T = TypeVar("T")
BUCKET = 1 << 26  # gradient elements per all-reduce (256 MB in fp32)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")  # this rank's device (cuda:LOCAL_RANK on CUDA)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """The items whose index % world == rank."""
        return [item for i, item in enumerate(items) if i % self.world == self.rank]

    def _comm_device(self) -> torch.device:
        return self.device if tdist.get_backend() == "nccl" else torch.device("cpu")

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """p.grad <- sum over ranks of p.grad, in flat fp32 buckets. A rank's None counts as zero;
        a parameter no rank has a gradient for keeps None (AdamW skips it, as in one process)."""
        if self.world == 1:
            return
        dev = self._comm_device()
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
        tdist.all_reduce(present)
        live = [p for p, n in zip(params, present.tolist()) if n > 0]
        start = 0
        while start < len(live):
            end, size = start + 1, live[start].numel()
            while end < len(live) and size + live[end].numel() <= BUCKET:
                size, end = size + live[end].numel(), end + 1
            bucket = live[start:end]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dev, torch.float32) for p in bucket])
            tdist.all_reduce(flat)
            for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad = part.view_as(p).to(p.device, p.dtype)
            start = end

    def all_reduce_scalar(self, x: float) -> float:
        """Sum of x over ranks."""
        if self.world == 1:
            return float(x)
        t = torch.tensor([float(x)], dtype=torch.float64, device=self._comm_device())
        tdist.all_reduce(t)
        return float(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier(device_ids=[self.device.index]) if tdist.get_backend() == "nccl" else tdist.barrier()

    def on_main(self, fn: Callable[[], T]) -> T:
        """fn() on rank 0 only; every rank returns its (pickled) result or raises its exception,
        so a user mistake found on rank 0 stops all ranks cleanly instead of hanging them."""
        if self.world == 1:
            return fn()
        payload: list[Any] = [None]
        if self.is_main:
            try:
                payload[0] = (fn(), None)
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                payload[0] = (None, exc)
        tdist.broadcast_object_list(payload, src=0, device=self._comm_device())
        result, error = payload[0]
        if error is not None:
            raise error
        return result


def init_from_env(device: torch.device | str = "cpu") -> Dist:
    """The process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
    a single-process Dist when WORLD_SIZE is unset or 1. On CUDA each rank uses
    cuda:LOCAL_RANK and nccl, else gloo. Ranks other than 0 are silenced (rich consoles quiet).
    QFD_DIST_TIMEOUT_MIN (default 120): how long ranks wait for rank 0's data generation."""
    device = torch.device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    use_nccl = device.type == "cuda" and torch.cuda.is_available()
    if use_nccl:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        timeout = datetime.timedelta(minutes=float(os.environ.get("QFD_DIST_TIMEOUT_MIN", "120")))
        tdist.init_process_group("nccl" if use_nccl else "gloo", rank=rank, world_size=world, timeout=timeout)
        atexit.register(lambda: tdist.is_initialized() and tdist.destroy_process_group())
    from qfd.console import console, stdout

    console.quiet = stdout.quiet = rank != 0
    console.print(f"[dim]data-parallel over {world} ranks ({tdist.get_backend()}); rank 0 writes[/dim]")
    return Dist(rank=rank, world=world, device=device)
