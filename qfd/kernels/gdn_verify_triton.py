"""A verify step of the gated delta rule (2..32 tokens) in its parallel (WY) form, one Triton
kernel per layer: the same inputs and results as `gdn_triton`'s `_gated_delta_conv_kernel`.

That kernel walks the step's tokens one after another inside each program (two reductions
over d_k and the token's conv per token): on the H100 a compiled 16-token verify at
Qwen3.5-4B shape spends 55 us per layer in it, against 6.8 us for one token
(docs/benchmarks.md, tenth session). Here the tokens are one chunk of the chunkwise form
(`qfd.models.gdn.chunked_gated_delta`), done with small matrix products and no per-token
chain. With gamma_t = exp(g_1 + ... + g_t) within the step and S_0 the state before it:

    u = (I + A)^-1 (beta * (v - gamma * (k S_0))),   A_ti = beta_t (gamma_t / gamma_i) k_t.k_i  (i < t)
    o_t = gamma_t q_t S_0 + sum_{i<=t} (gamma_t / gamma_i) (q_t.k_i) u_i
    S_t = gamma_t S_0 + sum_{i<=t} (gamma_t / gamma_i) k_i u_i^T      (the rollback history)

(I + A)^-1 for the strictly lower-triangular A of a TP-token chunk is the exact finite product
(I - A)(I + A^2)(I + A^4)... (A^TP = 0): log2(TP) products instead of a triangular solve. Every
product runs in float32 (`input_precision="ieee"`). The S_t are independent of each other,
so writing the history is plain stores, not a chain.

Not yet timed on a GPU (tested under Triton's interpreter): off by default,
`QFD_GDN_VERIFY=chunk` turns it on.
"""

from __future__ import annotations

import os

import torch

from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, tl, triton  # noqa: F401 (tl: the kernel)

if _HAVE_TRITON:
    from qfd.kernels.gdn_triton import _save_conv_state, _window_program  # the loop kernel's shared pieces

CHUNK_VERIFY = os.environ.get("QFD_GDN_VERIFY", "loop") == "chunk"
MAX_TOKENS = 32  # a step of more tokens keeps the token loop


def takes(T: int) -> bool:
    """Whether a T-token step runs here (one token: the loop kernel is already one pass)."""
    return CHUNK_VERIFY and _HAVE_TRITON and 2 <= T <= MAX_TOKENS


if _HAVE_TRITON:

    @triton.jit
    def _conv_tile(win_ptr, cw_ptr, chan, chan_mask, offs_t, t_mask, W, KC: tl.constexpr, ROUND: tl.constexpr):
        """SiLU(depthwise conv) of every token of the step for channels `chan`: a [TP, len(chan)]
        tile, rounded like `gdn_triton._conv_silu` (to the window's dtype after the conv and
        after the SiLU); rows past the step's tokens are 0."""
        # built as [channels, tokens] so each load reads a channel's window columns contiguously
        mask = chan_mask[:, None] & t_mask[None, :]
        y = tl.zeros((chan.shape[0], offs_t.shape[0]), dtype=tl.float32)
        for i in tl.static_range(KC):
            w = tl.load(cw_ptr + chan * KC + i, mask=chan_mask, other=0.0).to(tl.float32)
            x = tl.load(win_ptr + chan[:, None] * W + offs_t[None, :] + i, mask=mask, other=0.0).to(tl.float32)
            y += x * w[:, None]
        if ROUND:
            y = y.to(win_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.sigmoid(y)
        if ROUND:
            y = y.to(win_ptr.dtype.element_ty).to(tl.float32)
        return tl.trans(tl.where(mask, y, 0.0))

    @triton.jit
    def _pick(vec, offs, t):
        """vec[t] of a register vector (t a compile-time index)."""
        return tl.sum(tl.where(offs == t, vec, 0.0), axis=0)

    @triton.jit
    def _gated_delta_chunk_kernel(
        win_ptr, cw_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, o_ptr, s_ptr, start_ptr, hist_ptr, conv_ptr,
        T, H, DV, HIST_T, C, W, KD, REP, scale, AB_ROW,
        DK: tl.constexpr, BV: tl.constexpr, TP: tl.constexpr, FACTORS: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, ROUND: tl.constexpr,
    ):
        """Program (batch*head, dv block), the arguments of `_gated_delta_conv_kernel`; TP: the
        step's tokens rounded up to a power of two >= 16 (tl.dot's smallest tile), FACTORS =
        log2(TP) - 1."""
        bh = tl.program_id(0)
        vb = tl.program_id(1)
        b, h, offs_k, offs_v, k_mask, v_mask, tile, tile_mask, win, c_q, c_k, c_v = _window_program(win_ptr, bh, vb, H, DV, C, W, KD, REP, DK, BV)
        offs_t = tl.arange(0, TP)
        t_mask = offs_t < T

        # the step's inputs, all tokens at once (as conv_and_gates)
        q = _conv_tile(win, cw_ptr, c_q, k_mask, offs_t, t_mask, W, KC, ROUND)  # [TP, DK]
        k = _conv_tile(win, cw_ptr, c_k, k_mask, offs_t, t_mask, W, KC, ROUND)
        v = _conv_tile(win, cw_ptr, c_v, v_mask, offs_t, t_mask, W, KC, ROUND)  # [TP, BV]
        q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * scale)[:, None]  # prepare_qk
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        ab = (b * T + offs_t) * AB_ROW + h
        a_t = tl.load(a_ptr + ab, mask=t_mask, other=0.0).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
        softplus = tl.where(a_t > 20.0, a_t, tl.log(1.0 + tl.exp(tl.minimum(a_t, 20.0))))  # F.softplus's threshold
        g = tl.where(t_mask, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus, 0.0)
        beta = tl.sigmoid(tl.load(b_ptr + ab, mask=t_mask, other=0.0).to(tl.float32))
        if ROUND:
            beta = beta.to(b_ptr.dtype.element_ty).to(tl.float32)
        beta = tl.where(t_mask, beta, 0.0)  # padded tokens: no write (and k = 0, g = 0: no decay)
        G = tl.cumsum(g, axis=0)  # log gamma
        gamma = tl.exp(G)

        state_off = bh * DK * DV
        s0 = tl.load(s_ptr + state_off + tile, mask=tile_mask, other=0.0)  # [DK, BV]
        tl.store(start_ptr + state_off + tile, s0, mask=tile_mask)

        rows = offs_t[:, None]
        cols = offs_t[None, :]
        ratio = tl.exp(tl.minimum(G[:, None] - G[None, :], 0.0))  # gamma_t / gamma_i (<= 1 where i <= t)
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")  # [TP, TP]
        a_mat = tl.where(cols < rows, beta[:, None] * ratio * kk, 0.0)
        # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A is nilpotent (A^TP = 0)
        eye = tl.where(rows == cols, 1.0, 0.0)
        power = -a_mat
        inverse = eye + power
        for _ in tl.static_range(FACTORS):
            power = tl.dot(power, power, input_precision="ieee")
            inverse = tl.dot(inverse, eye + power, input_precision="ieee")
        ks0 = tl.dot(k, s0, input_precision="ieee")  # [TP, BV]
        rhs = beta[:, None] * (v - gamma[:, None] * ks0)
        u = tl.dot(inverse, rhs, input_precision="ieee")  # [TP, BV] corrected values

        qk = tl.where(cols <= rows, ratio * tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)
        out = gamma[:, None] * tl.dot(q, s0, input_precision="ieee") + tl.dot(qk, u, input_precision="ieee")
        row = (b * T + offs_t) * H + h
        tl.store(o_ptr + row[:, None] * DV + offs_v[None, :], out, mask=t_mask[:, None] & v_mask[None, :])

        # the state after every token (independent of each other), then the final one
        kt = tl.trans(k)  # [DK, TP]
        s_t = s0
        for t in tl.static_range(TP):
            g_t = _pick(G, offs_t, t)
            weights = tl.where(offs_t <= t, tl.exp(tl.minimum(g_t - G, 0.0)), 0.0)  # gamma_t / gamma_i, i <= t
            s_t = tl.exp(g_t) * s0 + tl.dot(kt * weights[None, :], u, input_precision="ieee")
            tl.store(hist_ptr + ((b * HIST_T + t) * H + h) * DK * DV + tile, s_t, mask=tile_mask & (t < T) & (t < HIST_T))
        tl.store(s_ptr + state_off + tile, s_t, mask=tile_mask)  # padded tokens leave it as after token T-1
        _save_conv_state(conv_ptr, win, b, h, vb, C, W, T, REP, c_q, c_k, c_v, k_mask, v_mask, KC, KCP)


def launch(window, conv_weight, a, b, A_log, dt_bias, out, state, start, history, conv_state, k_heads: int, ab_row: int, block_v: int, num_warps: int) -> None:
    """`_gated_delta_chunk_kernel` over the step (`gdn_triton.gated_delta_conv_step`'s tensors;
    a, b already in the row layout `ab_row` apart)."""
    B, C, W = window.shape
    T, H = a.shape[1], a.shape[2]
    dk, dv = state.shape[-2], state.shape[-1]
    kc = conv_weight.shape[-1]
    tp = max(16, triton.next_power_of_2(T))
    _gated_delta_chunk_kernel[(B * H, triton.cdiv(dv, block_v))](
        window, conv_weight, a, b, A_log, dt_bias, out, state, start, history, conv_state,
        T, H, dv, history.shape[1], C, W, k_heads * dk, H // k_heads, dk**-0.5, ab_row,
        DK=dk, BV=block_v, TP=tp, FACTORS=tp.bit_length() - 2, KC=kc, KCP=triton.next_power_of_2(kc),
        ROUND=window.dtype != torch.float32, num_warps=num_warps,
    )
