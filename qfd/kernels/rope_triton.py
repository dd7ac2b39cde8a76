"""Rotary embedding of one q or k tensor in one Triton launch, for graphed, uncompiled steps.

torch runs `qfd.models.rope.apply_rope` on a partially rotated head (Qwen3.5: 64 of 256
channels) as six kernels - a negation and a cat for rotate_half, two products, a sum, the cat
with the channels that pass through - twelve per attention layer for q and k. Here one program
rotates one (batch, head, token) row, with torch's rounding points: round(x * cos) and
round(rotate_half(x) * sin) in the tensor's dtype, then their rounded sum (negation is exact).
The output is contiguous [B, heads, T, hd], as the torch form's final cat makes it.

QFD_FUSED_ROPE=1 turns it on inside graphed steps (`qfd.kernels.graphed_step`), not under
torch.compile (inductor fuses torch's form). Off by default: tested under Triton's interpreter
and compiled for sm_90, not yet timed on a GPU.
"""

from __future__ import annotations

import os

import torch

from qfd.kernels import HAVE_TRITON, in_graphed_step, launch_or_fallback, tl, triton  # noqa: F401 (tl: the kernel)

if HAVE_TRITON:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, HEADS, T, HD, ROT, sx_b, sx_h, sx_t, sc_t, BD: tl.constexpr):
        """Row `program_id(0)` = (b, head, t) of y [B, HEADS, T, HD] (contiguous) from x (strides
        sx_b, sx_h, sx_t; 1 along HD); channels below ROT rotate, the rest pass through."""
        pid = tl.program_id(0)
        t = pid % T
        hd = (pid // T) % HEADS
        b = pid // (T * HEADS)
        offs = tl.arange(0, BD)
        mask = offs < HD
        row = x_ptr + b * sx_b + hd * sx_h + t * sx_t
        x = tl.load(row + offs, mask=mask, other=0.0)
        half = ROT // 2
        rot = offs < ROT
        partner = tl.where(offs < half, offs + half, offs - half)  # rotate_half: [-x2, x1]
        xp = tl.load(row + partner, mask=rot, other=0.0).to(tl.float32)
        xp = tl.where(offs < half, -xp, xp)
        c = tl.load(cos_ptr + t * sc_t + offs, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * sc_t + offs, mask=rot, other=0.0).to(tl.float32)
        dt = y_ptr.dtype.element_ty
        rotated = (x.to(tl.float32) * c).to(dt).to(tl.float32) + (xp * s).to(dt).to(tl.float32)
        tl.store(y_ptr + pid * HD + offs, tl.where(rot, rotated.to(dt), x.to(dt)), mask=mask)


def enabled() -> bool:
    """QFD_FUSED_ROPE=1 (read at each call: the A/B bench switches it)."""
    return os.environ.get("QFD_FUSED_ROPE", "0") == "1"


def use_kernel(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `apply_rope` of x runs the kernel: not under torch.compile (checked first), switched
    on, inside a graphed step, CUDA, cos / sin [T, rotary_dim] in x's dtype."""
    if torch.compiler.is_compiling():
        return False
    return (enabled() and in_graphed_step() and HAVE_TRITON and x.is_cuda and x.dim() == 4 and cos.dim() == 2
            and cos.dtype == x.dtype and cos.shape[0] == x.shape[2] and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= x.shape[-1])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd] (any strides with unit stride along hd), cos / sin [T, rotary_dim]
    (the same strides) -> rotated, contiguous [B, heads, T, hd]."""
    from qfd.models.rope import apply_rope as torch_form

    B, H, T, hd = x.shape

    def launch():
        x_ = x if x.stride(-1) == 1 else x.contiguous()
        c, s = cos.contiguous(), sin.contiguous()
        y = torch.empty(B, H, T, hd, dtype=x.dtype, device=x.device)
        _rope_kernel[(B * H * T,)](x_, c, s, y, H, T, hd, c.shape[-1], x_.stride(0), x_.stride(1), x_.stride(2), c.stride(0),
                                   BD=triton.next_power_of_2(hd), num_warps=1 if hd <= 256 else 2)
        return y

    return launch_or_fallback("rope", launch, lambda: torch_form(x, cos, sin, fused=False).contiguous())
