"""The across-chunk part of the chunkwise gated delta rule (long prompts) as one Triton kernel.

`qfd.models.gdn.chunked_gated_delta` does everything inside a chunk with batched torch ops
(one triangular solve per chunk, all chunks at once), then carries the state from chunk to
chunk: in torch a Python loop of ~9 small ops per chunk. An 8K-token prompt has 128 chunks of
64, so at Qwen3.5-4B shape (24 Gated DeltaNet layers) that loop alone launches ~28K kernels,
each a few microseconds of GPU work behind its launch: the eager prefill is launch-bound.

Here one program owns a [DK, BV] slice of one head's state (kept in place in the output
state, L2-resident, in [32, BV] key blocks) and walks all the chunks: per chunk the corrected
values, the chunk's outputs and the next state, small products in float32
(`input_precision="ieee"`: the torch loop's float32 math, summed in another order). One launch
per layer instead of ~9 per chunk. (Its first version held the whole [DK, BV] slice and
[C, DK] tiles in registers: at DK = 128, C = 64 it did not fit on the H100, whose profile of
an 8K prefill still showed the torch loop's 12K small fp32 GEMMs.)

Same results as `qfd.models.gdn.chunk_recurrence` (the torch loop, used where this cannot run:
no Triton or no GPU, autograd, or a head size the kernel's tiles do not take).
"""

from __future__ import annotations

import torch

from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, launch_or_fallback, runs_on, tl, triton  # noqa: F401 (tl: the kernel)

if _HAVE_TRITON:

    @triton.jit
    def _chunk_recurrence_kernel(
        kc_ptr, nv_ptr, qs_ptr, ks_ptr, intra_ptr, cd_ptr, s_ptr, o_ptr,
        N, DV, C: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ):
        """Program (head bh, value block): for chunk i = 0..N-1, with S the state entering it,
        v_new = nv_i - kc_i S, out_i = qs_i S + intra_i v_new, S <- cd_i S + ks_i^T v_new.
        Row-major tensors: kc, qs, ks [BH, N, C, DK]; nv, out [BH, N, C, DV]; intra
        [BH, N, C, C]; cd [BH, N]; s [BH, DK, DV], the state, updated in place chunk by chunk
        (its [DK, BV] slice stays in L2). The key dimension goes in blocks of BK, so no tile
        is over [C, BK] (whole [C, DK] fp32 tiles overflow shared memory at DK = 128)."""
        bh = tl.program_id(0)
        offs_c = tl.arange(0, C)
        offs_b = tl.arange(0, BK)
        offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
        v_mask = offs_v[None, :] < DV
        s_base = s_ptr + bh * DK * DV + offs_b[:, None] * DV + offs_v[None, :]  # a [BK, BV] block
        cb = offs_c[:, None] * DK + offs_b[None, :]  # a [C, BK] block of a [C, DK] chunk
        cv = offs_c[:, None] * DV + offs_v[None, :]
        cc = offs_c[:, None] * C + offs_c[None, :]
        for i in range(N):
            chunk = bh * N + i
            predicted = tl.zeros((C, BV), dtype=tl.float32)
            out = tl.zeros((C, BV), dtype=tl.float32)
            for k0 in range(0, DK, BK):
                state = tl.load(s_base + k0 * DV, mask=v_mask, other=0.0)
                kc = tl.load(kc_ptr + chunk * C * DK + k0 + cb)
                qs = tl.load(qs_ptr + chunk * C * DK + k0 + cb)
                predicted += tl.dot(kc, state, input_precision="ieee")
                out += tl.dot(qs, state, input_precision="ieee")
            v_new = tl.load(nv_ptr + chunk * C * DV + cv, mask=v_mask, other=0.0) - predicted
            intra = tl.load(intra_ptr + chunk * C * C + cc)
            out += tl.dot(intra, v_new, input_precision="ieee")
            tl.store(o_ptr + chunk * C * DV + cv, out, mask=v_mask)
            decay = tl.load(cd_ptr + chunk)
            tl.debug_barrier()  # every thread's reads of this chunk's state precede the writes below
            for k0 in range(0, DK, BK):
                state = tl.load(s_base + k0 * DV, mask=v_mask, other=0.0)
                ks = tl.load(ks_ptr + chunk * C * DK + k0 + cb)
                state = state * decay + tl.dot(tl.trans(ks), v_new, input_precision="ieee")
                tl.store(s_base + k0 * DV, state, mask=v_mask)
            tl.debug_barrier()  # the next chunk reads what other threads wrote


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def kernel_takes(k_cumdecay: torch.Tensor, new_values: torch.Tensor) -> bool:
    """True when the kernel can run on these [B, H, n, C, d] float32 tensors here: Triton on
    their device, no autograd, chunk and key head sizes powers of two >= 16 (tl.dot tiles)."""
    C, dk = k_cumdecay.shape[-2:]
    grad = torch.is_grad_enabled() and (k_cumdecay.requires_grad or new_values.requires_grad)
    return runs_on(k_cumdecay) and not grad and _pow2(C) and _pow2(dk) and new_values.shape[-1] >= 16


def chunk_recurrence_triton(k_cumdecay, new_values, q_scaled, k_scaled, intra, chunk_decay, state, fallback):
    """As `qfd.models.gdn.chunk_recurrence` (its arguments: [B, H, n, C, d] float32, chunk_decay
    [B, H, n], state [B, H, dk, dv]) in one launch; `fallback()` computes it in torch should the
    kernel fail to compile or launch here (warned once)."""
    B, H, n, C, dk = k_cumdecay.shape
    dv = new_values.shape[-1]
    bv = 32 if dv >= 32 else 16

    def launch():
        final = state.float().contiguous().clone()
        out = torch.empty_like(new_values, memory_format=torch.contiguous_format)
        _chunk_recurrence_kernel[(B * H, triton.cdiv(dv, bv))](
            k_cumdecay.contiguous(), new_values.contiguous(), q_scaled.contiguous(), k_scaled.contiguous(), intra.contiguous(),
            chunk_decay.reshape(B * H, n).contiguous(), final, out, n, dv, C=C, DK=dk, BK=min(32, dk), BV=bv, num_warps=4,
        )
        return out, final

    return launch_or_fallback("gdn_chunk_recurrence", launch, fallback)
