"""INT4 grid math: round-to-grid, dequantize, fake-quant with a clipped straight-through estimator.

Conventions (qfd.quant.types.QuantizedWeight): codes q are integers in [qmin, qmax]
(symmetric -8..7, zero-point 0..15), scales s and zero points z are per group of `group_size`
consecutive input columns, and the dequantized weight is w_hat = (q - z) * s
(method.md section 1). All functions are pure; shapes: weights [out, in], scales/zeros
[out, in // group_size].
"""

from __future__ import annotations

import torch

from qfd.errors import QfdError
from qfd.quant.types import QuantizedWeight

SUPPORTED_BITS = (4,)
SUPPORTED_GROUP_SIZES = (32, 64, 128)


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Integer range of a code: symmetric [-2^(b-1), 2^(b-1)-1], zero-point [0, 2^b - 1]."""
    if symmetric:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def check_supported(bits: int, group_size: int, where: str = "") -> None:
    """QfdError for bit widths / group sizes qfd does not handle."""
    prefix = f"{where}: " if where else ""
    if bits not in SUPPORTED_BITS:
        raise QfdError(f"{prefix}unsupported bit width {bits}; qfd handles INT{'/INT'.join(map(str, SUPPORTED_BITS))} only")
    if group_size not in SUPPORTED_GROUP_SIZES:
        sizes = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
        raise QfdError(f"{prefix}unsupported group size {group_size}; use one of {sizes}")


def expand_groups(per_group: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in // g] -> [out, in]: repeat every group value over its g columns."""
    return per_group.repeat_interleave(group_size, dim=1)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_hat = (q - z) * s in float32, cast to `dtype`. [out, in]."""
    codes = qw.codes.to(torch.float32)
    if qw.zeros is not None:
        codes = codes - expand_groups(qw.zeros.to(torch.float32), qw.group_size)
    return (codes * expand_groups(qw.scales.to(torch.float32), qw.group_size)).to(dtype)


def round_to_grid(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, bits: int = 4) -> torch.Tensor:
    """q = clamp(round(w / s) + z, qmin, qmax) with the given (frozen) scales/zeros. int8 [out, in]."""
    qmin, qmax = qrange(bits, zeros is None)
    s = expand_groups(scales.to(torch.float32), group_size)
    q = torch.round(weight.to(torch.float32) / s)
    if zeros is not None:
        q = q + expand_groups(zeros.to(torch.float32), group_size)
    return q.clamp_(qmin, qmax).to(torch.int8 if zeros is None else torch.uint8)


def requantize(qw: QuantizedWeight, weight: torch.Tensor) -> QuantizedWeight:
    """New codes for `weight` on qw's grid; scales/zeros/bias are the SAME tensors (bitwise)."""
    codes = round_to_grid(weight, qw.scales, qw.zeros, qw.group_size, qw.bits).to(qw.codes.dtype)
    return QuantizedWeight(codes=codes, scales=qw.scales, zeros=qw.zeros, group_size=qw.group_size, bits=qw.bits, bias=qw.bias)


def rtn_quantize(weight: torch.Tensor, group_size: int, bits: int = 4, symmetric: bool = True, scale_dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """Round-to-nearest min/max quantization per group. Symmetric: s = max|w| / (2^(b-1) - 1)
    (so -8 is reachable for negatives); zero-point: s = (max - min) / (2^b - 1), z = round(-min / s)."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise QfdError(f"in_features {in_features} is not a multiple of group size {group_size}")
    w = weight.to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    qmin, qmax = qrange(bits, symmetric)
    if symmetric:
        scales = (w.abs().amax(-1) / qmax).clamp_min(1e-8).to(scale_dtype)
        zeros = None
    else:
        wmin = w.amin(-1).clamp(max=0)
        wmax = w.amax(-1).clamp(min=0)
        scales = ((wmax - wmin) / qmax).clamp_min(1e-8).to(scale_dtype)
        zeros = torch.round(-wmin / scales.to(torch.float32)).clamp(qmin, qmax).to(torch.uint8)
    codes = round_to_grid(weight, scales, zeros, group_size, bits)
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, group_size=group_size, bits=bits)


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: w_hat = (clamp(round(w/s) + z, qmin, qmax) - z) * s per group. Backward: clipped
    STE, dL/dw = dL/dw_hat where the latent is representable, else 0 (method.md section 1)."""

    @staticmethod
    def forward(ctx, weight, scales, zeros, group_size, qmin, qmax):  # type: ignore[override]
        out_features, in_features = weight.shape
        w = weight.to(torch.float32).reshape(out_features, in_features // group_size, group_size)
        s = scales.to(torch.float32).unsqueeze(-1)
        x = w / s
        if zeros is not None:
            x = x + zeros.to(torch.float32).unsqueeze(-1)
        # representable: the latent rounds to a code inside [qmin, qmax] without clamping
        inside = (x >= qmin - 0.5) & (x <= qmax + 0.5)
        q = torch.round(x).clamp_(qmin, qmax)
        if zeros is not None:
            q = q - zeros.to(torch.float32).unsqueeze(-1)
        ctx.save_for_backward(inside)
        return (q * s).reshape(out_features, in_features).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (inside,) = ctx.saved_tensors
        return grad * inside.reshape(grad.shape).to(grad.dtype), None, None, None, None, None


def fake_quant(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, bits: int = 4) -> torch.Tensor:
    """Fake-quantize latent `weight` [out, in] on FROZEN per-group scales/zeros [out, in // g].

    A latent whose w/s + z lies within [qmin - 0.5, qmax + 0.5] (it rounds to a code without
    clamping) passes its gradient straight through; one beyond gets zero gradient."""
    qmin, qmax = qrange(bits, zeros is None)
    return _FakeQuantSTE.apply(weight, scales, zeros, group_size, qmin, qmax)
