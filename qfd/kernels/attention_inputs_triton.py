"""An attention step's inputs in one Triton launch, for graphed, uncompiled steps.

Between its q/k/v projection and the attention kernels, an uncompiled Qwen3.5 attention layer
ran 16 launches: the q and k norms (`norm_triton`), six for each rotary embedding (a negation,
two cats, two products, a sum: Qwen3.5 rotates 64 of 256 channels) and two index copies that
write K and V into the cache. Here one launch does all of it: the program for (token, role)
- a query head: its norm, its rotation, stored as q [B, heads, T, hd] (contiguous, as the torch
  form's final cat makes it);
- a key head: the same with the key norm, stored straight into the key cache at the token's slot;
- a value head: copied into the value cache at the token's slot.
Rounding points are the modules': the norm rounds to the dtype (`norm_triton.reference`), the
rotation then rounds x * cos and rotate_half(x) * sin and their sum (`qfd.models.rope.apply_rope`).

It runs inside graphed steps (`qfd.kernels.graphed_step`), not under torch.compile (inductor
fuses the torch form); with it the layer also hands Qwen3.5's output gate to the attention's merge
kernel (`attention_triton.split_attention(gate=...)`) instead of a copy, a sigmoid and a product.
Graphed uncompiled INT4 decode on the H100: 2.661 ms with it vs 2.992 without (513 -> 369
launches), 2.569 with the residual adds joined to the norms too (docs/benchmarks.md,
twenty-third session). QFD_FUSED_QKV=0 turns it off.
"""

from __future__ import annotations

import os

import torch

from qfd.kernels import HAVE_TRITON, in_graphed_step, launch_or_fallback, tl, triton  # noqa: F401 (tl: the kernel)

NO_NORM, PLAIN, ZERO_CENTERED = -1, 0, 1  # PLAIN / ZERO_CENTERED as norm_triton's modes

if HAVE_TRITON:

    @triton.jit
    def _normed(x, w_ptr, offs, mask, r, NORM: tl.constexpr, dt):
        """x (float32) normalised by the row's factor r and weighted as the norm modules do, rounded to dt."""
        if NORM == 0:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            return (w * (x * r).to(dt).to(tl.float32)).to(dt)
        if NORM == 1:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            return (x * r * (1.0 + w)).to(dt)
        return x.to(dt)

    @triton.jit
    def _norm_rotate_store(src, w_ptr, cos_row, sin_row, dst, HD, ROT, eps, BD: tl.constexpr, NORM: tl.constexpr):
        """One head's row at src (unit stride): normed, its first ROT channels rotated, stored at dst."""
        offs = tl.arange(0, BD)
        mask = offs < HD
        dt = dst.dtype.element_ty
        x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        half = ROT // 2
        rot = offs < ROT
        partner = tl.where(offs < half, offs + half, offs - half)  # rotate_half: [-x2, x1]
        xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
        r = 1.0
        if NORM >= 0:
            r = tl.math.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
        y = _normed(x, w_ptr, offs, mask, r, NORM, dt).to(tl.float32)
        yp = _normed(xp, w_ptr, partner, rot, r, NORM, dt).to(tl.float32)
        yp = tl.where(offs < half, -yp, yp)
        c = tl.load(cos_row + offs, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_row + offs, mask=rot, other=0.0).to(tl.float32)
        rotated = (y * c).to(dt).to(tl.float32) + (yp * s).to(dt).to(tl.float32)
        tl.store(dst + offs, tl.where(rot, rotated, y).to(dt), mask=mask)

    @triton.jit
    def _attention_inputs_kernel(
        q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr, qo_ptr, kc_ptr, vc_ptr,
        T, H, KVH, HD, ROT, eps,
        sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sc_t,
        skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
        BD: tl.constexpr, NORM: tl.constexpr,
    ):
        """Program (b * T + t, role): role < H a query head, then KVH key heads, then KVH value heads."""
        bt = tl.program_id(0)
        role = tl.program_id(1)
        b = bt // T
        t = bt % T
        if role < H:
            _norm_rotate_store(q_ptr + b * sq_b + t * sq_t + role * sq_h, qw_ptr, cos_ptr + t * sc_t, sin_ptr + t * sc_t,
                               qo_ptr + ((b * H + role) * T + t) * HD, HD, ROT, eps, BD, NORM)
        else:
            slot = tl.load(slot_ptr + t)
            if role < H + KVH:
                head = role - H
                _norm_rotate_store(k_ptr + b * sk_b + t * sk_t + head * sk_h, kw_ptr, cos_ptr + t * sc_t, sin_ptr + t * sc_t,
                                   kc_ptr + b * skc_b + head * skc_h + slot * skc_s, HD, ROT, eps, BD, NORM)
            else:
                head = role - H - KVH
                offs = tl.arange(0, BD)
                mask = offs < HD
                x = tl.load(v_ptr + b * sv_b + t * sv_t + head * sv_h + offs, mask=mask, other=0.0)
                tl.store(vc_ptr + b * svc_b + head * svc_h + slot * svc_s + offs, x.to(vc_ptr.dtype.element_ty), mask=mask)


def enabled() -> bool:
    """On unless QFD_FUSED_QKV=0 (read at each call: the A/B bench switches it)."""
    return os.environ.get("QFD_FUSED_QKV", "1") != "0"


def use_kernel(q: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a step's attention inputs go through the kernel: not under torch.compile (checked
    first), switched on, inside a graphed step, CUDA, cos / sin and the cache in q's dtype, a
    head of at most 1024 channels."""
    if torch.compiler.is_compiling():
        return False
    return (enabled() and in_graphed_step() and HAVE_TRITON and q.is_cuda and cos.dtype == q.dtype == k_cache.dtype
            and q.shape[-1] <= 1024)


def _norm_mode(norm) -> int:
    if norm is None:
        return NO_NORM
    return ZERO_CENTERED if norm.zero_centered else PLAIN


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, hd], k / v [B, T, KVH, hd] (views of the projection: unit stride along hd),
    q_norm / k_norm the layer's RMSNorm modules (or None), cos / sin [T, rotary_dim], caches
    [B, KVH, S, hd], slots [T]: writes the rotated keys and the values at their slots and returns
    the rotated queries [B, H, T, hd] (contiguous)."""
    B, T, H, hd = q.shape
    kvh = k.shape[2]

    def launch():
        c, s = cos.contiguous(), sin.contiguous()
        out = torch.empty(B, H, T, hd, dtype=q.dtype, device=q.device)
        mode = _norm_mode(q_norm)
        eps = q_norm.eps if q_norm is not None else 0.0
        weights = (q_norm.weight, k_norm.weight) if q_norm is not None else (q, q)  # (never read without a norm)
        _attention_inputs_kernel[(B * T, H + 2 * kvh)](
            q, k, v, *weights, c, s, slots, out, k_cache, v_cache, T, H, kvh, hd, c.shape[-1], eps,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), c.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            BD=triton.next_power_of_2(hd), NORM=mode, num_warps=1 if hd <= 256 else 2,
        )
        return out

    return launch_or_fallback("attention_inputs", launch, lambda: reference(q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache, slots))


def reference(q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
    """The attention layer's torch form of `prepare` (what it runs without the kernel)."""
    from qfd.models.rope import apply_rope

    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q = apply_rope(q.transpose(1, 2), cos, sin).contiguous()
    k = apply_rope(k.transpose(1, 2), cos, sin)
    k_cache.index_copy_(2, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(2, slots, v.transpose(1, 2).to(v_cache.dtype))
    return q
