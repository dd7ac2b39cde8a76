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

A draft tree's verify (`gdn_triton.gated_delta_tree_step`) is the same with the lower
triangle replaced by each node's ancestors (the closure of the parent links, by repeated
squaring) and gamma_t the decay along the node's path.

Measured slower than the token loop on an H100 (2026-12-06, bench/bench_gdn_step.py, a
16-token step at Qwen3.5-4B shape: 79.4 us with 16-wide blocks, 121.9 with 32-wide, against
the loop's 41.7): off by default, `QFD_GDN_VERIFY=chunk` turns it on for both. Kept for other
GPUs and longer steps, where its fixed cost of matrix products may win.
"""

from __future__ import annotations

import os

import torch

from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, tl, triton  # noqa: F401 (tl: the kernel)

if _HAVE_TRITON:
    from qfd.kernels.gdn_triton import _save_conv_state, _window_program  # the loop kernel's shared pieces

CHUNK_VERIFY = os.environ.get("QFD_GDN_VERIFY", "loop") == "chunk"
MAX_TOKENS = 32  # a step of more tokens keeps the token loop
# Its own launch split (tl.dot needs 16-wide tiles; the loop kernel's 8-wide one-warp blocks do
# not fit it): the faster of the two timed, bench/bench_gdn_step.py on an H100 (2026-12-06).
BLOCK_V, NUM_WARPS = 16, 4


def takes(T: int) -> bool:
    """Whether a T-token step runs here (one token: the loop kernel is already one pass)."""
    return CHUNK_VERIFY and _HAVE_TRITON and 2 <= T <= MAX_TOKENS


if _HAVE_TRITON:

    @triton.jit
    def _conv_tile(win_ptr, cw_ptr, chan, chan_mask, offs_t, t_mask, WC, WW, KC: tl.constexpr, ROUND: tl.constexpr):
        """SiLU(depthwise conv) of every token of the step for channels `chan`: a [TP, len(chan)]
        tile, rounded like `gdn_triton._silu_of_conv` (to the window's dtype after the conv and
        after the SiLU); rows past the step's tokens are 0."""
        # built as [channels, tokens]: a channels-last window's loads are contiguous along the channels
        mask = chan_mask[:, None] & t_mask[None, :]
        y = tl.zeros((chan.shape[0], offs_t.shape[0]), dtype=tl.float32)
        for i in tl.static_range(KC):
            w = tl.load(cw_ptr + chan * KC + i, mask=chan_mask, other=0.0).to(tl.float32)
            x = tl.load(win_ptr + chan[:, None] * WC + (offs_t[None, :] + i) * WW, mask=mask, other=0.0).to(tl.float32)
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
    def _wy_step(q, k, v, beta, gamma, ratio, s0, rows, cols, FACTORS: tl.constexpr):
        """The step in the WY form from its [TP, d] inputs, the state slice s0 [DK, BV], gamma
        [TP] and ratio [TP, TP] (gamma_t / gamma_i where token i is t or one of the tokens t
        continues, else 0: a lower triangle for a chain, the ancestors for a tree). Returns the
        corrected values u and the outputs, both [TP, BV]."""
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        a_mat = tl.where(cols < rows, beta[:, None] * ratio * kk, 0.0)  # the tokens before t on its path
        # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: A is nilpotent (A^TP = 0)
        eye = tl.where(rows == cols, 1.0, 0.0)
        power = -a_mat
        inverse = eye + power
        for _ in tl.static_range(FACTORS):
            power = tl.dot(power, power, input_precision="ieee")
            inverse = tl.dot(inverse, eye + power, input_precision="ieee")
        rhs = beta[:, None] * (v - gamma[:, None] * tl.dot(k, s0, input_precision="ieee"))
        u = tl.dot(inverse, rhs, input_precision="ieee")
        qk = ratio * tl.dot(q, tl.trans(k), input_precision="ieee")
        out = gamma[:, None] * tl.dot(q, s0, input_precision="ieee") + tl.dot(qk, u, input_precision="ieee")
        return u, out

    @triton.jit
    def _write_states(s0, k, u, ratio, gamma, offs_t, hist_ptr, b, h, H, T, HIST_T, DV, tile, tile_mask, DK: tl.constexpr, TP: tl.constexpr):
        """The state after every token t < T into the history (independent of each other:
        gamma_t s0 + sum_i ratio[t, i] k_i u_i^T); returns the last one computed (token TP-1)."""
        kt = tl.trans(k)  # [DK, TP]
        s_t = s0
        for t in tl.static_range(TP):
            weights = tl.sum(tl.where(offs_t[:, None] == t, ratio, 0.0), axis=0)  # row t of ratio
            s_t = _pick(gamma, offs_t, t) * s0 + tl.dot(kt * weights[None, :], u, input_precision="ieee")
            tl.store(hist_ptr + ((b * HIST_T + t) * H + h) * DK * DV + tile, s_t, mask=tile_mask & (t < T) & (t < HIST_T))
        return s_t

    @triton.jit
    def _gated_delta_chunk_kernel(
        win_ptr, cw_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, o_ptr, s_ptr, start_ptr, hist_ptr, conv_ptr,
        T, H, DV, HIST_T, C, WB, WC, WW, KD, REP, scale, AB_ROW,
        DK: tl.constexpr, BV: tl.constexpr, TP: tl.constexpr, FACTORS: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, ROUND: tl.constexpr,
    ):
        """Program (batch*head, dv block), the arguments of `_gated_delta_conv_kernel`; TP: the
        step's tokens rounded up to a power of two >= 16 (tl.dot's smallest tile), FACTORS =
        log2(TP) - 1."""
        bh = tl.program_id(0)
        vb = tl.program_id(1)
        b, h, offs_k, offs_v, k_mask, v_mask, tile, tile_mask, win, c_q, c_k, c_v = _window_program(win_ptr, bh, vb, H, DV, WB, KD, REP, DK, BV)
        offs_t = tl.arange(0, TP)
        t_mask = offs_t < T

        # the step's inputs, all tokens at once (as conv_and_gates)
        q = _conv_tile(win, cw_ptr, c_q, k_mask, offs_t, t_mask, WC, WW, KC, ROUND)  # [TP, DK]
        k = _conv_tile(win, cw_ptr, c_k, k_mask, offs_t, t_mask, WC, WW, KC, ROUND)
        v = _conv_tile(win, cw_ptr, c_v, v_mask, offs_t, t_mask, WC, WW, KC, ROUND)  # [TP, BV]
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
        ratio = tl.where(cols <= rows, tl.exp(tl.minimum(G[:, None] - G[None, :], 0.0)), 0.0)  # gamma_t / gamma_i, i <= t
        u, out = _wy_step(q, k, v, beta, gamma, ratio, s0, rows, cols, FACTORS)
        row = (b * T + offs_t) * H + h
        tl.store(o_ptr + row[:, None] * DV + offs_v[None, :], out, mask=t_mask[:, None] & v_mask[None, :])
        s_t = _write_states(s0, k, u, ratio, gamma, offs_t, hist_ptr, b, h, H, T, HIST_T, DV, tile, tile_mask, DK, TP)
        tl.store(s_ptr + state_off + tile, s_t, mask=tile_mask)  # padded tokens leave it as after token T-1
        _save_conv_state(conv_ptr, win, b, h, vb, C, WC, WW, T, REP, c_q, c_k, c_v, k_mask, v_mask, KC, KCP)


if _HAVE_TRITON:

    @triton.jit
    def _gated_delta_tree_chunk_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, par_ptr, o_ptr, s_ptr, hist_ptr,
        T, H, DV, HIST_T,
        DK: tl.constexpr, BV: tl.constexpr, TP: tl.constexpr, FACTORS: tl.constexpr,
    ):
        """A draft tree's nodes in the WY form: node t continues its parent's state (parents
        [T] int64, parents before children), so the chain's lower triangle becomes each node's
        ancestors, and gamma_t the decay along its path. Prepared inputs as `gdn_triton`'s
        `_gated_delta_tree_kernel` (q/k [B, T, H, DK], v/o [B, T, H, DV], g/beta [B, T, H],
        float32); writes every node's state to the history and leaves the state as it was."""
        bh = tl.program_id(0)
        b, h = bh // H, bh % H
        offs_t = tl.arange(0, TP)
        t_mask = offs_t < T
        offs_k = tl.arange(0, DK)
        offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
        v_mask = offs_v < DV
        tile = offs_k[:, None] * DV + offs_v[None, :]
        tile_mask = (offs_k[:, None] < DK) & v_mask[None, :]
        row = (b * T + offs_t) * H + h
        q = tl.load(q_ptr + row[:, None] * DK + offs_k[None, :], mask=t_mask[:, None], other=0.0)  # [TP, DK]
        k = tl.load(k_ptr + row[:, None] * DK + offs_k[None, :], mask=t_mask[:, None], other=0.0)
        v = tl.load(v_ptr + row[:, None] * DV + offs_v[None, :], mask=t_mask[:, None] & v_mask[None, :], other=0.0)
        g = tl.load(g_ptr + row, mask=t_mask, other=0.0)
        beta = tl.load(b_ptr + row, mask=t_mask, other=0.0)

        # ancestors-or-self: the closure of (I + parent one-hot) by repeated squaring (exact 0/1)
        rows = offs_t[:, None]
        cols = offs_t[None, :]
        parent = tl.load(par_ptr + offs_t, mask=t_mask & (offs_t > 0), other=-1)
        path = tl.where((rows == cols) | (cols == parent[:, None]), 1.0, 0.0)
        for _ in tl.static_range(FACTORS + 1):  # log2(TP) squarings cover depth TP
            path = tl.minimum(tl.dot(path, path, input_precision="ieee"), 1.0)
        G = tl.sum(path * g[None, :], axis=1)  # log decay along each node's path
        gamma = tl.exp(G)
        ratio = tl.where(path > 0.5, tl.exp(tl.minimum(G[:, None] - G[None, :], 0.0)), 0.0)  # gamma_t / gamma_i on the path

        s0 = tl.load(s_ptr + bh * DK * DV + tile, mask=tile_mask, other=0.0)
        u, out = _wy_step(q, k, v, beta, gamma, ratio, s0, rows, cols, FACTORS)
        tl.store(o_ptr + row[:, None] * DV + offs_v[None, :], out, mask=t_mask[:, None] & v_mask[None, :])
        _write_states(s0, k, u, ratio, gamma, offs_t, hist_ptr, b, h, H, T, HIST_T, DV, tile, tile_mask, DK, TP)


def _tokens_tile(T: int) -> tuple[int, int]:
    """(TP, FACTORS): T rounded up to a power of two >= 16 (tl.dot's smallest tile), log2(TP) - 1."""
    tp = max(16, triton.next_power_of_2(T))
    return tp, tp.bit_length() - 2


def launch_tree(q, k, v, g, beta, parents, out, state, history) -> None:
    """`_gated_delta_tree_chunk_kernel` over a tree step (`gdn_triton.gated_delta_tree_step`'s
    tensors, contiguous float32; parents int64)."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    tp, factors = _tokens_tile(T)
    _gated_delta_tree_chunk_kernel[(B * H, triton.cdiv(dv, BLOCK_V))](
        q, k, v, g, beta, parents, out, state, history, T, H, dv, history.shape[1],
        DK=dk, BV=BLOCK_V, TP=tp, FACTORS=factors, num_warps=NUM_WARPS,
    )


def launch(window, conv_weight, a, b, A_log, dt_bias, out, state, start, history, conv_state, k_heads: int, ab_row: int) -> None:
    """`_gated_delta_chunk_kernel` over the step (`gdn_triton.gated_delta_conv_step`'s tensors;
    a, b already in the row layout `ab_row` apart)."""
    B, C, _ = window.shape
    T, H = a.shape[1], a.shape[2]
    dk, dv = state.shape[-2], state.shape[-1]
    kc = conv_weight.shape[-1]
    tp, factors = _tokens_tile(T)
    _gated_delta_chunk_kernel[(B * H, triton.cdiv(dv, BLOCK_V))](
        window, conv_weight, a, b, A_log, dt_bias, out, state, start, history, conv_state,
        T, H, dv, history.shape[1], C, *window.stride(), k_heads * dk, H // k_heads, dk**-0.5, ab_row,
        DK=dk, BV=BLOCK_V, TP=tp, FACTORS=factors, KC=kc, KCP=triton.next_power_of_2(kc),
        ROUND=window.dtype != torch.float32, num_warps=NUM_WARPS,
    )
