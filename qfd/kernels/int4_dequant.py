"""Dequantize a packed INT4 weight (`qfd.kernels.int4_triton`'s layout) in one Triton kernel,
for long prefills: Int4Linear runs inputs of more than KERNEL_MAX_ROWS["triton"] rows as
x @ w_t through cuBLAS, with w_t rebuilt every call (the INT4 model keeps no dense copy).

The output is w_hat TRANSPOSED, w_t [K, N] row-major: column n of the packed `qweight`
[K_pad/8, N] int32 holds output n, so a program that reads a [16, BLOCK_N] block of words
writes 128 rows of BLOCK_N consecutive outputs, coalesced on both sides. `x @ w_t` is as good a
cuBLAS call as `F.linear(x, w_hat)`.

Arithmetic as `int4_layout.dequantize_packed`: w = (u - z) * s in float32 (u - z exact,
one rounding in the product), then one rounding to `dtype`: bit-exact against it.

The pure-torch `dequantize_packed` chain took ~1 ms per linear at 9216x2560 on the H200 (eight
unpacking shifts, a stack, repeat_interleave of the scales, float32 temporaries): a memory-bound
kernel reads the 12 MB of codes + scales and writes 47 MB of bf16 once.
"""

from __future__ import annotations

import torch

from qfd.kernels import HAVE_TRITON, launch_or_fallback, runs_on, tl, triton  # noqa: F401 (tl: the kernel)
from qfd.kernels.int4_layout import TILE_K, TritonInt4Weight, check_group_size, dequantize_packed

BLOCK_N = 128  # outputs per program: a [16, 128] int32 block in, 128 rows x 256 bytes (bf16) out
NUM_WARPS = 4

if HAVE_TRITON:
    from qfd.kernels.int4_triton import _nibble_k

    @triton.jit
    def _int4_dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, K, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BN: tl.constexpr):
        """One program: K tile t (packed rows 16t..16t+15) x outputs [BN*pid_n, +BN), written as
        rows k = 128t + 32 (j mod 4) + 2p + j // 4 of out [K, N] (nibble j of packed row 16t + p)."""
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_p = tl.arange(0, 16)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        words = tl.load(q_ptr + (t * 16 + offs_p)[:, None] * N + offs_n[None, :], mask=(offs_p[:, None] < 16) & n_mask[None, :], other=0)
        for j in tl.static_range(8):
            # nibble j's rows lie in one group (GROUP is a multiple of 32); nibbles j and j + 4 share it
            if (32 * (j % 4)) % GROUP == 0 and (j == 0 or GROUP < 128):
                g = (t * 128 + 32 * (j % 4)) // GROUP
                s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                if HAS_ZEROS:
                    z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
                else:
                    z = tl.full((BN,), 8.0, tl.float32)
            u = ((words >> (4 * j)) & 0xF).to(tl.float32)
            w = (u - z[None, :]) * s[None, :]
            offs_k = t * 128 + _nibble_k(j) + 2 * offs_p
            # int64 row offsets: K * N of a large head (2560 x 248K) nears int32's range
            ptrs = out_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :]
            tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=(offs_k < K)[:, None] & n_mask[None, :])


def dequantize_to(packed_qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, in_features: int,
                  dtype: torch.dtype, *, block_n: int = BLOCK_N) -> torch.Tensor:
    """w_hat.T [in_features, N] row-major in `dtype`, from the packed layout (`pack_for_triton`:
    qweight [K_pad/8, N] int32, scales and zeros [K_pad/g, N]) by the Triton kernel."""
    if not HAVE_TRITON:
        raise RuntimeError("dequantize_to: triton is not installed (use int4_dequant_op, which falls back to torch)")
    g = int(group_size)
    check_group_size(g, "dequantize_to")
    k_pad, n = packed_qweight.shape[0] * 8, packed_qweight.shape[1]
    if not (0 < in_features <= k_pad) or k_pad % TILE_K != 0:
        raise ValueError(f"dequantize_to: packed qweight {tuple(packed_qweight.shape)} does not hold {in_features} inputs")
    qweight, scales = packed_qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    out = torch.empty(in_features, n, dtype=dtype, device=qweight.device)
    grid = (-(-in_features // TILE_K), -(-n // block_n))  # tiles wholly beyond K (padding) write nothing: skipped
    _int4_dequant_kernel[grid](
        qweight, scales, zeros if zeros is not None else scales, out, n, in_features,
        GROUP=g, HAS_ZEROS=zeros is not None, BN=block_n, num_warps=NUM_WARPS,
    )
    return out


@torch.library.custom_op("qfd::int4_dequant", mutates_args=())
def int4_dequant_op(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, in_features: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_to` as an opaque torch op (torch.compile keeps one call, as `int4_mm_op`).
    Without Triton, or on CPU tensors outside Triton's interpreter, the float32 torch
    reference `dequantize_packed`, transposed: the same values."""

    def reference():
        counters = qweight.new_zeros(0)  # the matmul's split-K counters: unused by dequantize_packed
        packed = TritonInt4Weight(qweight, scales, zeros, counters, group_size, in_features, qweight.shape[1])
        return dequantize_packed(packed, dtype).t().contiguous()

    if not runs_on(qweight):
        return reference()
    # not yet run on a GPU (tested under Triton's interpreter): guarded
    return launch_or_fallback("int4_dequant", lambda: dequantize_to(qweight, scales, zeros, group_size, in_features, dtype), reference)


@int4_dequant_op.register_fake
def _int4_dequant_fake(qweight, scales, zeros, group_size, in_features, dtype):
    return qweight.new_empty(in_features, qweight.shape[1], dtype=dtype)
