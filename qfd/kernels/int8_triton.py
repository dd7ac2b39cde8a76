"""W8A16 matmul in Triton for the LM head (`--int8-head`): y = x @ w_hat.T, w_hat = q * s,
q int8 in [-127, 127], one scale per output row and K group.

Why a kernel of its own: at batch 1 the head is read once per step, and Qwen3.5-4B's tied
248320 x 2560 head is 1.27 GB in bf16 - 40% of an INT4 decode's bytes. INT8 halves them
(INT4, `--int4-head`, quarters them but moves the logits much further: qfd.quant.head).

Layout (`quantize_int8`): q [N, K] int8 row-major (nn.Linear's orientation, K contiguous: one
program's [BN, GROUP] tile is BN runs of GROUP contiguous bytes); scales [K / GROUP, N] in the
activations' dtype (a group's BN scales are one contiguous load). Per K group: one partial sum
in float32, times the group's scales; int8 values are exact in bf16 / fp16, so the tensor-core
path converts the tile and multiplies with fp32 accumulation.

Two paths, chosen by rows (`pick_config`):
- USE_DOT (2+ rows: a verify): [BM, GROUP] x [GROUP, BN] on tensor cores, rows padded to BM.
- otherwise (1 row: a decode): CUDA cores, a multiply and a row sum per weight - the product
  is bandwidth-bound, and a 16-row MMA would pad 15 rows of zeros. (Keeping [BN, GROUP]
  partial products and summing the rows once at the end measured 5% slower on the H100.)
Measured (H100, bench/bench_head.py): 0.233 / 0.240 / 0.250 ms at 1 / 16 / 32 rows against
cuBLAS bf16's 0.453 / 0.454 / 0.458 (1.94x / 1.89x / 1.83x), 2770 GB/s at one row.
No split-K: the head's N is large (248320 / 64 = 3880 programs); K is the hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qfd.kernels import HAVE_TRITON, launch_or_fallback, runs_on, tl, triton  # noqa: F401 (tl: the kernel)

QMAX = 127  # symmetric: -127..127 (-128 unused, so q * s is symmetric around 0)


@dataclass(frozen=True)
class Int8Config:
    use_dot: bool
    block_n: int
    block_m: int = 16
    num_warps: int = 4
    num_stages: int = 3


def pick_config(m: int, dtype: torch.dtype = torch.bfloat16) -> Int8Config:
    """Launch parameters by row count (1: CUDA-core path; 2-32: tensor cores, 16 or 32 rows a block)."""
    # bench_head.py's fastest configs on the H100 at 248320 x 2560 (docs/benchmarks.md,
    # 2026-12-07 twenty-fourth session), per row count; one row reads 2770 GB/s
    if m == 1:
        return Int8Config(use_dot=False, block_n=64, num_warps=8, num_stages=3)
    if m <= 16:
        return Int8Config(use_dot=True, block_n=32, block_m=16, num_warps=4, num_stages=3)
    # float32 x doubles the x tiles: 4 stages take 105 KB of shared memory per block, more than an
    # A10G / L4 (sm_86 / 89) has (99 KB); 3 take 81 KB (bf16: 48 KB at 4; bench/compile_kernels.py)
    return Int8Config(use_dot=True, block_n=64, block_m=32, num_warps=4, num_stages=3 if dtype == torch.float32 else 4)


def quantize_int8(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int8, scales [K / group, N] in `scale_dtype`): symmetric round
    to nearest per (row, group), scale = max |w| / 127 rounded to `scale_dtype` first, so q is
    nearest for the scale the kernel reads (a zero group gets scale 1, q = 0)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"INT8 head: width {k} is not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    scale = w.abs().amax(-1, keepdim=True) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype).float()
    q = (w / scale).round().clamp(-QMAX, QMAX).to(torch.int8).reshape(n, k)
    return q, scale.squeeze(-1).t().to(scale_dtype).contiguous()


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [N, K], scales [K / g, N]) -> w_hat [N, K] in `dtype` (products in float32)."""
    n, k = q.shape
    groups = scales.shape[0]
    w = q.float().reshape(n, groups, k // groups) * scales.float().t().unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


REFERENCE_CHUNK = 8192  # outputs dequantized at a time by `reference_matmul` (84 MB of float32 at K = 2560)


def reference_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's result in torch: float32 math, cast to x's dtype. The weight is dequantized
    REFERENCE_CHUNK outputs at a time, so the kernel's fallback on a GPU never holds a whole
    head in float32 (2.5 GB at Qwen3.5-4B's 248K x 2560)."""
    xf = x.float()
    parts = [xf @ dequantize_int8(q[i:i + REFERENCE_CHUNK], scales[:, i:i + REFERENCE_CHUNK]).t() for i in range(0, q.shape[0], REFERENCE_CHUNK)]
    return torch.cat(parts, -1).to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _int8_matmul_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                            GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, USE_DOT: tl.constexpr,
                            NUM_STAGES: tl.constexpr):
        """Outputs [BM * pid_m, +BM) x [BN * pid_n, +BN); the K loop steps one group."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        offs_g = tl.arange(0, GROUP)
        offs_m = pid_m * BM + tl.arange(0, BM)
        m_mask = offs_m < M
        if USE_DOT:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        else:
            acc = tl.zeros((BN,), dtype=tl.float32)
        for g in tl.range(0, K // GROUP, num_stages=NUM_STAGES):
            k0 = g * GROUP
            w = tl.load(q_ptr + offs_n[:, None] * K + (k0 + offs_g)[None, :], mask=n_mask[:, None], other=0)  # [BN, GROUP] int8
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if USE_DOT:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_g)[None, :], mask=m_mask[:, None], other=0.0)
                if x_ptr.dtype.element_ty == tl.float32:
                    part = tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)))
                acc += part * s[None, :]
            else:
                x = tl.load(x_ptr + k0 + offs_g).to(tl.float32)
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1) * s
        y_dtype = y_ptr.dtype.element_ty
        if USE_DOT:
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_dtype), mask=m_mask[:, None] & n_mask[None, :])
        else:
            tl.store(y_ptr + offs_n, acc.to(y_dtype), mask=n_mask)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, config: Int8Config | None = None) -> torch.Tensor:
    """x [..., K] @ w_hat.T -> [..., N] in x's dtype, through the Triton kernel (CUDA, or the
    interpreter). Any leading shape; rows are flattened."""
    n, k = q.shape
    group = k // scales.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    cfg = config or pick_config(m, x.dtype)
    if not cfg.use_dot and m != 1:
        raise ValueError("the CUDA-core INT8 path takes one row")
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m) if cfg.use_dot else 1)
    _int8_matmul_kernel[grid](x2, q, scales, y, m, n, k, x2.stride(0), y.stride(0), GROUP=group, BM=cfg.block_m, BN=cfg.block_n,
                              USE_DOT=cfg.use_dot, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return y.reshape(*lead, n)


@torch.library.custom_op("qfd::int8_mm", mutates_args=())
def int8_mm_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` as an opaque torch op (torch.compile keeps it as one call). Where Triton
    cannot run (CPU tensors outside the interpreter), or the kernel failed to build here, it
    computes `reference_matmul`: same weights, float32 math."""
    if not runs_on(x):
        return reference_matmul(x, q, scales)
    return launch_or_fallback("int8_matmul", lambda: int8_matmul(x, q, scales), lambda: reference_matmul(x, q, scales))


@int8_mm_op.register_fake
def _int8_mm_fake(x, q, scales):
    return x.new_empty(*x.shape[:-1], q.shape[0])
