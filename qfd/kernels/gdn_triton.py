"""The gated delta rule of a decode / verify step (T <= 16 tokens) as one Triton kernel.

`qfd.models.gdn.recurrent_gated_delta` steps token by token in torch: per token two einsums
(cuBLAS GEMVs over the [dk, dv] state), the decay, the update, and a copy of the state into the
rollback history. At Qwen3.5-4B shape on the H200 a compiled 16-token verify spends ~4 of its
~10.5 ms there (profile in docs/benchmarks.md: 768 GEMV launches, a 70 us history copy per
layer). Here one program owns a [dk, BV] slice of one head's state in registers for the whole
step: it saves the starting state (rollback to 0 tokens), runs the T updates, writes each
position's output and state (the history) and the final state in place. The state is read
once and written 1 + T times: at bandwidth, ~10 us per layer for a 16-token verify.

Same arguments and float32 math as `recurrent_gated_delta` (q, k prepared by `prepare_qk`).
"""

from __future__ import annotations

import torch

from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, runs_on, tl, triton  # noqa: F401 (tl: the kernel)


if _HAVE_TRITON:

    @triton.jit
    def _gated_delta_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, s_ptr, start_ptr, hist_ptr,
        T, H, DV, HIST_T,
        DK: tl.constexpr, BV: tl.constexpr,
    ):
        """Program (batch*head, dv block): q/k [B, T, H, DK], v/o [B, T, H, DV], g/beta [B, T, H],
        state/start [B, H, DK, DV], history [B, HIST_T, H, DK, DV]; all contiguous, float32."""
        bh = tl.program_id(0)
        b, h = bh // H, bh % H
        offs_k = tl.arange(0, DK)
        offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
        v_mask = offs_v < DV
        tile = offs_k[:, None] * DV + offs_v[None, :]
        tile_mask = (offs_k[:, None] < DK) & v_mask[None, :]
        state_off = bh * DK * DV
        state = tl.load(s_ptr + state_off + tile, mask=tile_mask, other=0.0)
        tl.store(start_ptr + state_off + tile, state, mask=tile_mask)
        for t in range(T):
            row = (b * T + t) * H + h
            k_t = tl.load(k_ptr + row * DK + offs_k)
            q_t = tl.load(q_ptr + row * DK + offs_k)
            v_t = tl.load(v_ptr + row * DV + offs_v, mask=v_mask, other=0.0)
            decay = tl.exp(tl.load(g_ptr + row))
            beta = tl.load(b_ptr + row)
            state = state * decay
            predicted = tl.sum(k_t[:, None] * state, axis=0)  # [BV]
            delta = (v_t - predicted) * beta
            state = state + k_t[:, None] * delta[None, :]
            out = tl.sum(q_t[:, None] * state, axis=0)
            tl.store(o_ptr + row * DV + offs_v, out, mask=v_mask)
            hist_off = ((b * HIST_T + t) * H + h) * DK * DV
            tl.store(hist_ptr + hist_off + tile, state, mask=tile_mask)
        tl.store(s_ptr + state_off + tile, state, mask=tile_mask)


@torch.library.custom_op("qfd::gated_delta_step", mutates_args=("state", "start", "history"))
def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, start: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """One decode / verify step of the gated delta rule, in place: `start` <- `state` (the
    state before the step), `history[:, t]` <- the state after position t, `state` <- the
    final state. q, k: [B, T, H, dk] prepared; v: [B, T, H, dv]; g, beta: [B, T, H].
    Returns the output [B, T, H, dv] float32. Without a usable Triton: the torch reference."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    if not runs_on(q):
        from qfd.models.gdn import recurrent_gated_delta

        start.copy_(state)
        out, final = recurrent_gated_delta(q, k, v, g, beta, state, history=history)
        state.copy_(final)
        return out
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(B, T, H, dv, dtype=torch.float32, device=q.device)
    block_v = 32
    _gated_delta_kernel[(B * H, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, out, state, start, history, T, H, dv, history.shape[1],
        DK=dk, BV=block_v, num_warps=4,
    )
    return out


@gated_delta_step.register_fake
def _gated_delta_step_fake(q, k, v, g, beta, state, start, history):
    return q.new_empty(*v.shape, dtype=torch.float32)
