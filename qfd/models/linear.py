"""`Linear`: nn.Linear with a CPU fast path for few rows (decode, a short verify, k drafts).

Why: on a CPU a float32 `F.linear(x, W)` (W [out, in] row-major) is MKL's
SGEMM(T, N, m=out, n=rows, k=in). With n of 1 MKL runs a GEMV, and with n of 2-8 a small-n
kernel that re-reads W for each row or so: weights the size of a model's, which stream from
DRAM at every step, come in at a fraction of the memory bandwidth. The LM head of SmolLM2-135M
(W [49152, 576], 113 MB) took 10.7 ms for 1 row and 17-35 ms for 2-8 rows on 2 AMD EPYC
cores (torch 2.13, oneMKL 2024.0). The same product computed as `W @ x.T` is SGEMM(T, N,
m=rows, n=out, k=in): the small dimension on MKL's other side, whose kernel streams W once -
4.3 ms for 2 rows, 8.8 ms for 8. A single row is given a duplicate (m = 2), since m = 1 is a
GEMV again: 5.2 ms instead of 10.7. The hidden-size linears gain alike (2-3x for 1-4 rows
with cold weights), so a decode step, a 2-9-token verify and the drafter's LM head over k
slots all get cheaper. Beyond 8 rows MKL's small-n kernels catch up and `W @ x.T` is no
better (9-16) or worse (12-15 rows): those rows keep F.linear.

The result is the same GEMM blocked another way: equal to F.linear up to float32 rounding (not
bit for bit - neither are F.linear's own kernels across row counts). Only float32 on the CPU
takes it; bf16 goes to oneDNN's brgemm, which already handles few rows well and is slower
through `W @ x.T`. Everything else - CUDA (so CUDA graphs capture the same ops as before),
other dtypes, more rows - is F.linear as in nn.Linear. The path is plain autograd-safe torch
ops, so training through these modules works either way. Parameters, state-dict keys, init and
`isinstance(m, nn.Linear)` are nn.Linear's: quantization (GPTQ hooks, Int4Linear swaps) and
loading see no difference.

Measurements: bench/results/cpu_2026-12-04_small_row_linear.json (bench_cpu_draft_len.py
--small-rows 0,8); other CPUs and MKL builds may choose kernels differently:
QFD_LINEAR_SMALL_ROWS=N sets the threshold (0 turns the path off).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Most rows (product of the leading dims) that take the W @ x.T path; chosen by measurement
# (module docstring). Read at call time, so tests and benchmarks may change it.
SMALL_ROWS = int(os.environ.get("QFD_LINEAR_SMALL_ROWS", "8"))


def small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x2d.T).T (one row doubled): the same
    values through MKL's other GEMM kernels. Returns a contiguous [..., out] like F.linear."""
    x2d = x.reshape(-1, x.shape[-1])
    rows = x2d.shape[0]
    if rows == 1:
        x2d = torch.cat([x2d, x2d])  # m = 1 would be MKL's GEMV again
    if bias is None:
        y = torch.mm(weight, x2d.T)  # [out, rows]
    else:
        y = torch.addmm(bias.unsqueeze(1), weight, x2d.T)
    return y[:, :rows].T.contiguous().view(*x.shape[:-1], weight.shape[0])


def use_small_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `Linear` takes `small_rows_linear` for this input."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() >= 1
        and 0 < x.numel() <= SMALL_ROWS * x.shape[-1]
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `small_rows_linear` where `use_small_rows` says it is faster."""
    if use_small_rows(x, weight):
        return small_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, keys and init) whose forward takes `small_rows_linear` for
    at most SMALL_ROWS float32 rows on the CPU; see the module docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def gated_mlp_hidden(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a SwiGLU MLP (the target's and the drafter's): from its gate_proj and
    up_proj, or from their fusion (qfd.models.fuse) - `gate_up_proj` cut by `gate_up_sizes`, or a
    gated pair (`Int4Linear.gated_pair`) that returns the activation itself."""
    fused = mlp.gate_up_proj
    if fused is None:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    elif getattr(fused, "gated", False):
        return fused(x)
    else:
        gate, up = torch.split(fused(x), mlp.gate_up_sizes, dim=-1)
    return F.silu(gate) * up
