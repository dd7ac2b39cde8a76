"""The gated delta rule of a decode / verify step (T <= 16 tokens) as one Triton kernel.

`qfd.models.gdn.recurrent_gated_delta` steps token by token in torch: per token two einsums
(cuBLAS GEMVs over the [dk, dv] state), the decay, the update, and a copy of the state into the
rollback history. At Qwen3.5-4B shape on the H200 a compiled 16-token verify spends ~4 of its
~10.5 ms there (profile in docs/benchmarks.md: 768 GEMV launches, a 70 us history copy per
layer). Here one program owns a [dk, BV] slice of one head's state in registers for the whole
step: it saves the starting state (rollback to 0 tokens), runs the T updates, writes each
position's output and state (the history) and the final state in place. The state is read
once and written 1 + T times: at bandwidth, ~10 us per layer for a 16-token verify.

The conv form's per-token chain was bound by dependent global loads issued after the previous
token's stores (the compiler does not hoist loads above stores): `PREFETCH` selects a variant
that loads the loop invariants (conv weights) and every token's gates before the token loop and
each next token's conv window columns before the current token's compute and stores (software
pipelining by one token). Same float32 ops and rounding points as the plain loop.

Same arguments and float32 math as `recurrent_gated_delta` (q, k prepared by `prepare_qk`).
"""

from __future__ import annotations

import os

import torch

from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, launch_or_fallback, runs_on, tl, triton  # noqa: F401 (tl: the kernel)


# Each program owns a [dk, BLOCK_V] slice of one head's state: at Qwen3.5-4B shape 32 heads x
# 128/8 = 512 one-warp programs, several per SM, so one program's per-token chain (conv, two
# reductions over d_k) overlaps the others'. bench/bench_gdn_step.py on an H100 (2026-12-06):
# a 16-token step 67.0 -> 41.7 us against 32-wide blocks of 4 warps (one program per SM), one
# token 8.2 -> 7.9 us.
BLOCK_V = int(os.environ.get("QFD_GDN_BLOCK_V", "8"))
NUM_WARPS = int(os.environ.get("QFD_GDN_WARPS", "1"))
# `gated_delta_conv_step`'s token loop with its loads issued ahead (`_gated_delta_conv_prefetch_kernel`:
# conv weights and all tokens' gates before the loop, token t+1's window columns before token t's
# stores), against the ~2.3 us per extra token of the plain loop (41.7 us at 16 tokens vs 7.9 at
# one, H100) that the arithmetic does not explain. On the H200 (bench/bench_gdn_step.py
# --prefetch 0,1, docs/benchmarks.md 2026-12-06 eighteenth session) 37.0 -> 24.2 us at 16 tokens
# (1.53x), 7.7 -> 7.2 us at one, outputs and states equal to the plain loop's;
# QFD_GDN_PREFETCH=0 keeps the plain loop. Steps of more than PREFETCH_MAX_TOKENS
# tokens keep the plain loop (the gates of all tokens are held as [TP] vectors).
PREFETCH = os.environ.get("QFD_GDN_PREFETCH", "1") != "0"
PREFETCH_MAX_TOKENS = 64


if _HAVE_TRITON:

    @triton.jit
    def _delta_rule(state, q_t, k_t, v_t, decay, beta):
        """One token of the gated delta rule on a [DK, BV] state slice: (new state, output [BV],
        the token's delta [BV]: with k_t and decay what its update was)."""
        state = state * decay
        predicted = tl.sum(k_t[:, None] * state, axis=0)  # [BV]
        delta = (v_t - predicted) * beta
        state = _apply_update(state, k_t[:, None], delta[None, :])
        return state, tl.sum(q_t[:, None] * state, axis=0), delta

    @triton.jit
    def _apply_update(decayed, k, delta):
        """The state after a token's update, from the decayed state: one explicit fused
        multiply-add per element, so a rollback replaying the update from a token record
        (`gdn_rollback_triton`) rounds exactly as the step did."""
        return tl.fma(k, delta, decayed)

    @triton.jit
    def _state_tile(DV, DK: tl.constexpr, BV: tl.constexpr):
        """This program's [DK, BV] slice of a [DK, DV] state (dv block = program_id(1)):
        offsets along k and v, the v mask, the tile's offsets and mask."""
        offs_k = tl.arange(0, DK)
        offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
        v_mask = offs_v < DV
        tile = offs_k[:, None] * DV + offs_v[None, :]
        tile_mask = (offs_k[:, None] < DK) & v_mask[None, :]
        return offs_k, offs_v, v_mask, tile, tile_mask

    @triton.jit
    def _delta_rule_at(state, row, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, offs_k, offs_v, v_mask, DK: tl.constexpr, DV):
        """`_delta_rule` for token `row` of the prepared inputs (q/k [.., DK], v/o [.., DV],
        g/beta [..]): loads them, writes the output, returns the new state."""
        k_t = tl.load(k_ptr + row * DK + offs_k)
        q_t = tl.load(q_ptr + row * DK + offs_k)
        v_t = tl.load(v_ptr + row * DV + offs_v, mask=v_mask, other=0.0)
        decay = tl.exp(tl.load(g_ptr + row))
        beta = tl.load(b_ptr + row)
        state, out, _ = _delta_rule(state, q_t, k_t, v_t, decay, beta)
        tl.store(o_ptr + row * DV + offs_v, out, mask=v_mask)
        return state

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
        offs_k, offs_v, v_mask, tile, tile_mask = _state_tile(DV, DK, BV)
        state_off = bh * DK * DV
        state = tl.load(s_ptr + state_off + tile, mask=tile_mask, other=0.0)
        tl.store(start_ptr + state_off + tile, state, mask=tile_mask)
        for t in range(T):
            state = _delta_rule_at(state, (b * T + t) * H + h, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, offs_k, offs_v, v_mask, DK, DV)
            tl.store(hist_ptr + ((b * HIST_T + t) * H + h) * DK * DV + tile, state, mask=tile_mask)
        tl.store(s_ptr + state_off + tile, state, mask=tile_mask)


if _HAVE_TRITON:

    @triton.jit
    def _gated_delta_tree_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, s_ptr, hist_ptr, par_ptr,
        T, H, DV, HIST_T,
        DK: tl.constexpr, BV: tl.constexpr,
    ):
        """`_gated_delta_kernel` over the nodes of a draft tree: node 0 continues the state,
        node t > 0 its parent's (parents [T] int64, parents before children). The state tile
        stays in registers while a node follows the node before it (a chain, or a tree's
        first branch) and is read back from the history at a branch switch. The state itself
        is not changed (the engine keeps one node's state afterwards)."""
        bh = tl.program_id(0)
        b, h = bh // H, bh % H
        offs_k, offs_v, v_mask, tile, tile_mask = _state_tile(DV, DK, BV)
        state = tl.load(s_ptr + bh * DK * DV + tile, mask=tile_mask, other=0.0)
        for t in range(T):
            state = _tree_node(state, t, b, h, T, H, DV, HIST_T, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, hist_ptr, par_ptr, offs_k, offs_v, v_mask, tile, tile_mask, DK)

    @triton.jit
    def _tree_node(state, t, b, h, T, H, DV, HIST_T, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, hist_ptr, par_ptr, offs_k, offs_v, v_mask, tile, tile_mask, DK: tl.constexpr):
        """Tree node t: from its parent's state (the register tile when the parent is node
        t - 1, else read back from the history), the update, the node's history tile."""
        if t > 0:
            parent = tl.load(par_ptr + t)
            if parent != t - 1:
                tl.debug_barrier()  # the parent's history tile, written by other threads of this program
                parent_off = ((b * HIST_T + parent) * H + h) * DK * DV
                state = tl.load(hist_ptr + parent_off + tile, mask=tile_mask, other=0.0)
        state = _delta_rule_at(state, (b * T + t) * H + h, q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, offs_k, offs_v, v_mask, DK, DV)
        tl.store(hist_ptr + ((b * HIST_T + t) * H + h) * DK * DV + tile, state, mask=tile_mask)
        return state


if _HAVE_TRITON:

    @triton.jit
    def _silu_of_conv(w, x, ROUND: tl.constexpr):
        """SiLU(depthwise conv) of one token for a tile of channels: sum_i w[c, i] * window[c, t + i],
        rounded to the window's dtype after the conv and after the SiLU (as the torch module).
        w [channels, KCP] float32, x the window's [channels, KCP] columns in the window's dtype."""
        y = tl.sum(w * x.to(tl.float32), axis=1)
        if ROUND:
            y = y.to(x.dtype).to(tl.float32)
        y = y * tl.sigmoid(y)
        if ROUND:
            y = y.to(x.dtype).to(tl.float32)
        return y

    @triton.jit
    def _decay_beta(a_raw, b_raw, neg_a, dt_bias, ROUND: tl.constexpr):
        """The gates from the raw a/b (one token's scalars, or all tokens' vectors: elementwise,
        the same ops either way): decay = exp(-exp(A_log) * softplus(a + dt_bias)), beta =
        sigmoid(b), rounded to b's dtype as the module does."""
        a_t = a_raw.to(tl.float32) + dt_bias
        softplus = tl.where(a_t > 20.0, a_t, tl.log(1.0 + tl.exp(tl.minimum(a_t, 20.0))))  # F.softplus's threshold
        decay = tl.exp(neg_a * softplus)
        beta = tl.sigmoid(b_raw.to(tl.float32))
        if ROUND:
            beta = beta.to(b_raw.dtype).to(tl.float32)
        return decay, beta

    @triton.jit
    def _conv_token(state, t, b, h, vb, T, H, DV, HIST_T, AB_ROW, WC, WW, win, cw_ptr, a_ptr, b_ptr, o_ptr, hist_ptr, c_q, c_k, c_v,
                    k_mask, v_mask, offs_v, tile, tile_mask, neg_a, dt_bias, scale,
                    DK: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, ROUND: tl.constexpr, RECORDS: tl.constexpr):
        """Token t of `_gated_delta_conv_kernel`: its conv weights, window columns and gates
        loaded here, in the token's turn (after the previous token's stores), then
        `_conv_token_loaded`; returns the new state."""
        ab = (b * T + t) * AB_ROW + h
        decay, beta = _decay_beta(tl.load(a_ptr + ab), tl.load(b_ptr + ab), neg_a, dt_bias, ROUND)
        return _conv_token_loaded(state, t, b, h, vb, T, H, DV, HIST_T, o_ptr, hist_ptr,
                                  _window_columns(win, c_q, k_mask, t, T, WC, WW, KC, KCP), _window_columns(win, c_k, k_mask, t, T, WC, WW, KC, KCP),
                                  _window_columns(win, c_v, v_mask, t, T, WC, WW, KC, KCP), _conv_weights(cw_ptr, c_q, k_mask, KC, KCP),
                                  _conv_weights(cw_ptr, c_k, k_mask, KC, KCP), _conv_weights(cw_ptr, c_v, v_mask, KC, KCP),
                                  decay, beta, v_mask, offs_v, tile, tile_mask, scale, DK, ROUND, RECORDS)

    @triton.jit
    def _gated_delta_conv_kernel(
        win_ptr, cw_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, o_ptr, s_ptr, start_ptr, hist_ptr, conv_ptr,
        T, H, DV, HIST_T, C, WB, WC, WW, KD, REP, scale, AB_ROW,
        DK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, ROUND: tl.constexpr, RECORDS: tl.constexpr,
    ):
        """`_gated_delta_kernel` computing its own inputs: program (batch*head, dv block) reads
        the conv window [B, C, KC-1+T] (channels: q [0, KD), k [KD, 2KD), v [2KD, C); element
        (b, c, w) at b WB + c WC + w WW: channels first, or last under QFD_GDN_WINDOW),
        conv weights [C, KC], raw a/b [B, T, H] (rows AB_ROW apart: views of the fused
        projection's output), A_log/dt_bias [H]; value head h reads key
        head h // REP. It also writes the new conv state [B, C, KC-1] (the window's last KC-1
        columns) for its v channels, and for its key head's q/k channels when it is the first
        program of that key head."""
        bh = tl.program_id(0)
        vb = tl.program_id(1)
        b, h, offs_k, offs_v, k_mask, v_mask, tile, tile_mask, win, c_q, c_k, c_v = _window_program(win_ptr, bh, vb, H, DV, WB, KD, REP, DK, BV)
        neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        state_off = bh * DK * DV
        state = tl.load(s_ptr + state_off + tile, mask=tile_mask, other=0.0)
        tl.store(start_ptr + state_off + tile, state, mask=tile_mask)
        for t in range(T):
            state = _conv_token(state, t, b, h, vb, T, H, DV, HIST_T, AB_ROW, WC, WW, win, cw_ptr, a_ptr, b_ptr, o_ptr, hist_ptr, c_q, c_k, c_v,
                                k_mask, v_mask, offs_v, tile, tile_mask, neg_a, dt_bias, scale, DK, KC, KCP, ROUND, RECORDS)
        tl.store(s_ptr + state_off + tile, state, mask=tile_mask)
        _save_conv_state(conv_ptr, win, b, h, vb, C, WC, WW, T, REP, c_q, c_k, c_v, k_mask, v_mask, KC, KCP)

    @triton.jit
    def _window_program(win_ptr, bh, vb, H, DV, WB, KD, REP, DK: tl.constexpr, BV: tl.constexpr):
        """What a (batch*head, dv block) program of a conv-window step kernel reads: batch b, value
        head h (key head h // REP), the k/v offsets and masks, its [DK, BV] state tile's offsets and
        mask, its batch's window and its q/k/v channels (q [0, KD), k [KD, 2KD), v [2KD, C))."""
        b, h = bh // H, bh % H
        kh = h // REP
        offs_k = tl.arange(0, DK)
        offs_v = vb * BV + tl.arange(0, BV)
        k_mask = offs_k < DK
        v_mask = offs_v < DV
        tile = offs_k[:, None] * DV + offs_v[None, :]
        tile_mask = k_mask[:, None] & v_mask[None, :]
        c_q = kh * DK + offs_k
        return b, h, offs_k, offs_v, k_mask, v_mask, tile, tile_mask, win_ptr + b * WB, c_q, KD + c_q, 2 * KD + h * DV + offs_v

    @triton.jit
    def _save_conv_state(conv_ptr, win, b, h, vb, C, WC, WW, T, REP, c_q, c_k, c_v, k_mask, v_mask, KC: tl.constexpr, KCP: tl.constexpr):
        """The conv state after a T-token step: the window's last KC-1 columns, for the program's
        v channels, and for its key head's q/k channels by the first program of that key head."""
        taps = tl.arange(0, KCP)
        keep = (taps < KC - 1)[None, :]
        conv = conv_ptr + b * C * (KC - 1)
        tl.store(conv + c_v[:, None] * (KC - 1) + taps[None, :], tl.load(win + c_v[:, None] * WC + (T + taps[None, :]) * WW, mask=v_mask[:, None] & keep), mask=v_mask[:, None] & keep)
        if (h % REP == 0) & (vb == 0):
            qk_mask = k_mask[:, None] & keep
            tl.store(conv + c_q[:, None] * (KC - 1) + taps[None, :], tl.load(win + c_q[:, None] * WC + (T + taps[None, :]) * WW, mask=qk_mask), mask=qk_mask)
            tl.store(conv + c_k[:, None] * (KC - 1) + taps[None, :], tl.load(win + c_k[:, None] * WC + (T + taps[None, :]) * WW, mask=qk_mask), mask=qk_mask)


if _HAVE_TRITON:

    @triton.jit
    def _gated_delta_conv_prefetch_kernel(
        win_ptr, cw_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, o_ptr, s_ptr, start_ptr, hist_ptr, conv_ptr,
        T, H, DV, HIST_T, C, WB, WC, WW, KD, REP, scale, AB_ROW,
        DK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, ROUND: tl.constexpr, RECORDS: tl.constexpr, TP: tl.constexpr,
    ):
        """`_gated_delta_conv_kernel` (same arguments, results and float32 ops; TP: T rounded up
        to a power of two) with its loads issued ahead of the token chain: the conv weights and
        every token's gates before the loop, and in iteration t token t+1's window columns
        before token t's compute and stores (loads issued after a store wait for it: the
        compiler cannot prove they do not alias), so their latency overlaps token t's work."""
        bh = tl.program_id(0)
        vb = tl.program_id(1)
        b, h, offs_k, offs_v, k_mask, v_mask, tile, tile_mask, win, c_q, c_k, c_v = _window_program(win_ptr, bh, vb, H, DV, WB, KD, REP, DK, BV)
        neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        w_q = _conv_weights(cw_ptr, c_q, k_mask, KC, KCP)
        w_k = _conv_weights(cw_ptr, c_k, k_mask, KC, KCP)
        w_v = _conv_weights(cw_ptr, c_v, v_mask, KC, KCP)
        offs_t = tl.arange(0, TP)
        decays, betas = _all_gates(a_ptr, b_ptr, b, h, T, AB_ROW, offs_t, neg_a, dt_bias, ROUND)
        x_q = _window_columns(win, c_q, k_mask, 0, T, WC, WW, KC, KCP)
        x_k = _window_columns(win, c_k, k_mask, 0, T, WC, WW, KC, KCP)
        x_v = _window_columns(win, c_v, v_mask, 0, T, WC, WW, KC, KCP)
        state_off = bh * DK * DV
        state = tl.load(s_ptr + state_off + tile, mask=tile_mask, other=0.0)
        tl.store(start_ptr + state_off + tile, state, mask=tile_mask)
        for t in range(T):
            # token t+1's columns (none after the last token), in flight during token t
            next_q = _window_columns(win, c_q, k_mask, t + 1, T, WC, WW, KC, KCP)
            next_k = _window_columns(win, c_k, k_mask, t + 1, T, WC, WW, KC, KCP)
            next_v = _window_columns(win, c_v, v_mask, t + 1, T, WC, WW, KC, KCP)
            state = _conv_token_loaded(state, t, b, h, vb, T, H, DV, HIST_T, o_ptr, hist_ptr, x_q, x_k, x_v, w_q, w_k, w_v,
                                       _pick(decays, offs_t, t), _pick(betas, offs_t, t), v_mask, offs_v, tile, tile_mask, scale, DK, ROUND, RECORDS)
            x_q, x_k, x_v = next_q, next_k, next_v
        tl.store(s_ptr + state_off + tile, state, mask=tile_mask)
        _save_conv_state(conv_ptr, win, b, h, vb, C, WC, WW, T, REP, c_q, c_k, c_v, k_mask, v_mask, KC, KCP)

    @triton.jit
    def _conv_weights(cw_ptr, chan, chan_mask, KC: tl.constexpr, KCP: tl.constexpr):
        """The float32 [channels, KCP] conv weights of channels `chan` (taps past KC: 0)."""
        taps = tl.arange(0, KCP)
        return tl.load(cw_ptr + chan[:, None] * KC + taps[None, :], mask=chan_mask[:, None] & (taps < KC)[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _window_columns(win, chan, chan_mask, t, T, WC, WW, KC: tl.constexpr, KCP: tl.constexpr):
        """The window columns token t's conv reads for channels `chan`: [channels, KCP] in the
        window's dtype (converted at use: half the registers while in flight for 16-bit
        windows), all zero without a load for t >= T (the prefetch after the last token)."""
        taps = tl.arange(0, KCP)
        mask = chan_mask[:, None] & (taps < KC)[None, :] & (t < T)
        return tl.load(win + chan[:, None] * WC + (t + taps[None, :]) * WW, mask=mask, other=0.0)

    @triton.jit
    def _all_gates(a_ptr, b_ptr, b, h, T, AB_ROW, offs_t, neg_a, dt_bias, ROUND: tl.constexpr):
        """Decay and beta of all T tokens as [TP] vectors (0 past T), from one load of each of
        a and b: the per-token scalar loads were links of the token chain."""
        rows = (b * T + offs_t) * AB_ROW + h
        t_mask = offs_t < T
        return _decay_beta(tl.load(a_ptr + rows, mask=t_mask, other=0.0), tl.load(b_ptr + rows, mask=t_mask, other=0.0), neg_a, dt_bias, ROUND)

    @triton.jit
    def _pick(vec, offs_t, t):
        """Element t of a [TP] vector, in registers: a sum with one non-zero term (exact)."""
        return tl.sum(tl.where(offs_t == t, vec, 0.0), axis=0)

    @triton.jit
    def _conv_token_loaded(state, t, b, h, vb, T, H, DV, HIST_T, o_ptr, hist_ptr, x_q, x_k, x_v, w_q, w_k, w_v, decay, beta,
                           v_mask, offs_v, tile, tile_mask, scale, DK: tl.constexpr, ROUND: tl.constexpr, RECORDS: tl.constexpr):
        """`_conv_token` from inputs already in registers (window columns x_*, weights w_*, the
        token's gates): the same ops, then its output and its history tile - or, RECORDS, its
        record (k, delta, decay: `_token_record`); returns the new state."""
        q_t = _silu_of_conv(w_q, x_q, ROUND)
        k_t = _silu_of_conv(w_k, x_k, ROUND)
        v_t = _silu_of_conv(w_v, x_v, ROUND)
        q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t, axis=0) + 1e-6) * scale  # prepare_qk
        k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t, axis=0) + 1e-6)
        state, out, delta = _delta_rule(state, q_t, k_t, v_t, decay, beta)
        tl.store(o_ptr + ((b * T + t) * H + h) * DV + offs_v, out, mask=v_mask)
        if RECORDS:
            _token_record(hist_ptr + ((b * HIST_T + t) * H + h) * (DK + DV + 1), k_t, delta, decay, vb, offs_v, v_mask, DK, DV)
        else:  # not the last token's: a rollback keeping all T tokens is no rollback (and the state holds it)
            tl.store(hist_ptr + ((b * HIST_T + t) * H + h) * DK * DV + tile, state, mask=tile_mask & (t < T - 1))
        return state

    @triton.jit
    def _token_record(rec, k_t, delta, decay, vb, offs_v, v_mask, DK: tl.constexpr, DV):
        """A token's record [k (DK) | delta (DV) | decay] for one head: what its update was,
        from which a rollback rebuilds the state after it (DK + DV + 1 floats instead of the
        DK x DV state). Each program writes its delta slice; the first of the head also k and
        the decay."""
        tl.store(rec + DK + offs_v, delta, mask=v_mask)
        if vb == 0:
            tl.store(rec + tl.arange(0, DK), k_t)
            tl.store(rec + DK + DV, decay)


@torch.library.custom_op("qfd::gated_delta_conv_step", mutates_args=("state", "start", "history", "conv_state"))
def gated_delta_conv_step(window: torch.Tensor, conv_weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          state: torch.Tensor, start: torch.Tensor, history: torch.Tensor, conv_state: torch.Tensor, k_heads: int) -> torch.Tensor:
    """`gated_delta_step` from the layer's raw inputs: window [B, C, K-1+T] (conv state, then
    the new tokens' q/k/v channels), conv_weight [C, 1, K], a, b [B, T, H], A_log, dt_bias [H]
    (`qfd.models.gdn.conv_and_gates` computes the step's q/k/v/g/beta from them). Also writes
    the new conv state (`conv_state` [B, C, K-1] <- the window's last K-1 columns). `history`
    [B, >=T, H, dk, dv] receives the state after every position but the last (which is `state`:
    the token loop skips that store - a decode then writes no history - while the torch
    reference and the parallel form write it too), or, given as [B, >=T, H, dk + dv + 1], every
    token's record (k, delta, decay: `qfd.models.gdn.recurrent_gated_delta`'s `records`), 1/64
    of the bytes at dk = dv = 128. Returns the output [B, T, H, dv] float32. Without a usable
    Triton: the torch reference."""
    B, C, W = window.shape
    T, H = a.shape[1], a.shape[2]
    dk, dv = state.shape[-2], state.shape[-1]
    kc = conv_weight.shape[-1]
    records = history.dim() == 4  # [B, HIST_T, H, dk + dv + 1]: per-token records, not states

    def reference():  # conv and gates in torch, then the recurrence op (its kernel where it runs)
        from qfd.models.gdn import conv_and_gates, recurrent_gated_delta

        q, k, v, g, beta = conv_and_gates(window, conv_weight, a, b, A_log, dt_bias, (k_heads, dk, H, dv), window.dtype)
        if records:
            start.copy_(state)
            out, final = recurrent_gated_delta(q, k, v, g, beta, state, records=history)
            state.copy_(final)
        else:
            out = gated_delta_step(q, k, v, g, beta, state, start, history)
        conv_state.copy_(window[..., W - (kc - 1):])
        return out

    def launch():
        out = torch.empty(B, T, H, dv, dtype=torch.float32, device=window.device)
        a_, b_ = (a, b) if a.stride() == b.stride() and a.stride(2) == 1 and a.stride(0) == T * a.stride(1) else (a.contiguous(), b.contiguous())
        from qfd.kernels import gdn_verify_triton  # (it builds on this module's helpers)

        if gdn_verify_triton.takes(T) and not records:  # the tokens in parallel (WY form), not one after another
            gdn_verify_triton.launch(window, conv_weight.contiguous(), a_, b_, A_log, dt_bias, out, state, start, history, conv_state,
                                     k_heads, a_.stride(1))
            return out
        args = (window, conv_weight.contiguous(), a_, b_, A_log, dt_bias, out, state, start, history, conv_state,
                T, H, dv, history.shape[1], C, *window.stride(), k_heads * dk, H // k_heads, dk**-0.5, a_.stride(1))
        meta = dict(DK=dk, BV=BLOCK_V, KC=kc, KCP=triton.next_power_of_2(kc), ROUND=window.dtype != torch.float32, RECORDS=records, num_warps=NUM_WARPS)
        grid = (B * H, triton.cdiv(dv, BLOCK_V))
        if PREFETCH and T <= PREFETCH_MAX_TOKENS:  # (read at each call: the bench and tests switch it)
            _gated_delta_conv_prefetch_kernel[grid](*args, TP=triton.next_power_of_2(T), **meta)
        else:
            _gated_delta_conv_kernel[grid](*args, **meta)
        return out

    if not runs_on(window):
        return reference()
    # not yet run on a GPU (tested under Triton's interpreter): guarded
    return launch_or_fallback("gated_delta_conv_step", launch, reference)


@gated_delta_conv_step.register_fake
def _gated_delta_conv_step_fake(window, conv_weight, a, b, A_log, dt_bias, state, start, history, conv_state, k_heads):
    return window.new_empty(a.shape[0], a.shape[1], a.shape[2], state.shape[-1], dtype=torch.float32)


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
    _gated_delta_kernel[(B * H, triton.cdiv(dv, BLOCK_V))](
        q, k, v, g, beta, out, state, start, history, T, H, dv, history.shape[1],
        DK=dk, BV=BLOCK_V, num_warps=NUM_WARPS,
    )
    return out


@gated_delta_step.register_fake
def _gated_delta_step_fake(q, k, v, g, beta, state, start, history):
    return q.new_empty(*v.shape, dtype=torch.float32)


@torch.library.custom_op("qfd::gated_delta_tree_step", mutates_args=("history",))
def gated_delta_tree_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, history: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over a draft tree's nodes (`qfd.models.gdn.tree_gated_delta`):
    `history[:, t]` <- the state after node t, continuing node parents[t]'s (node 0: `state`,
    which is not changed). Returns the output [B, T, H, dv] float32. Without a usable Triton,
    or if the kernel fails (not yet run on a GPU: guarded), the torch reference."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]

    def reference():
        from qfd.models.gdn import tree_gated_delta

        return tree_gated_delta(q, k, v, g, beta, state, parents, history)

    def launch():
        from qfd.kernels import gdn_verify_triton  # (it builds on this module's helpers)

        q_, k_, v_, g_, b_ = (x.float().contiguous() for x in (q, k, v, g, beta))
        out = torch.empty(B, T, H, dv, dtype=torch.float32, device=q.device)
        if gdn_verify_triton.takes(T):  # the nodes in parallel (WY form over each node's path)
            gdn_verify_triton.launch_tree(q_, k_, v_, g_, b_, parents.to(torch.int64).contiguous(), out, state, history)
            return out
        _gated_delta_tree_kernel[(B * H, triton.cdiv(dv, BLOCK_V))](
            q_, k_, v_, g_, b_, out, state, history, parents.to(torch.int64).contiguous(), T, H, dv, history.shape[1],
            DK=dk, BV=BLOCK_V, num_warps=NUM_WARPS,
        )
        return out

    if not runs_on(q):
        return reference()
    return launch_or_fallback("gated_delta_tree_step", launch, reference)


@gated_delta_tree_step.register_fake
def _gated_delta_tree_step_fake(q, k, v, g, beta, state, history, parents):
    return q.new_empty(*v.shape, dtype=torch.float32)
