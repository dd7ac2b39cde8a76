"""The packed INT4 layout the Triton kernels read (`pack_for_triton`), and its pure-torch
inverse and reference product (what tests, the CPU path and fallbacks compare against).

Chosen so every weight load is a coalesced, 16-byte-per-thread row of N int32 and one mask-or
turns a word into a pair of 16-bit weights adjacent in K:
  qweight [K_pad / 8, N] int32. K is cut into tiles of 128; tile t owns packed rows
          16t .. 16t+15. Bits 4j..4j+3 of row 16t + p, column n hold the code u of weight
          (n, k = 128t + 32 (j mod 4) + 2p + j // 4): nibbles j and j + 4 (bits 4j and 4j + 16)
          are the K neighbours 2p and 2p + 1 of the 32-wide slice j, so
          ((word >> 4j) & 0x000F000F) | MAGIC is the pair as two 16-bit floats, the register
          a tensor-core operand holds (`_int4_mma_kernel`); nibble j alone is a stride-2 K slice
          of 16 (the CUDA-core paths).
  scales  [K_pad / g, N] (the QuantizedWeight's dtype), zeros [K_pad / g, N] uint8 or None.
  u = q + 8 for symmetric weights (zero point 8), u = q with per-group zeros otherwise.
  Group sizes: multiples of 32 dividing 128, or multiples of 128 (a 32-wide slice never
  straddles two groups).
K is padded to a multiple of 128 (padded weights have u = z: they contribute 0; x is masked).

GATED products (an MLP's gate/up pair) take a weight whose outputs interleave gate and up
column by column (`interleave_columns`); `silu_mul_interleaved` is their epilogue in torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qfd.quant.types import QuantizedWeight

TILE_K = 128  # K per packed tile (16 int32 rows x 8 nibbles)
COUNTER_TILES = 8192  # split-K counters per packed weight: the (M tiles) x (N tiles) a launch may use


@dataclass
class TritonInt4Weight:
    """Packed operands of one INT4 linear for `int4_matmul` (shapes in the module docstring)."""

    qweight: torch.Tensor  # [K_pad/8, N] int32
    scales: torch.Tensor  # [K_pad/g, N]
    zeros: torch.Tensor | None  # [K_pad/g, N] uint8, None = symmetric (zero point 8)
    counters: torch.Tensor  # [COUNTER_TILES] int32, zero between launches
    group_size: int
    in_features: int  # K (unpadded)
    out_features: int  # N

    @property
    def padded_in(self) -> int:
        return self.qweight.shape[0] * 8

    def nbytes(self) -> int:
        """Bytes a matmul must read for the weight (codes + scales + zeros)."""
        z = self.zeros.numel() * self.zeros.element_size() if self.zeros is not None else 0
        return self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size() + z


def check_group_size(group_size: int, who: str) -> None:
    """ValueError unless the layout takes this group size: a multiple of 32 dividing 128 (a
    32-wide slice, a nibble pair's span, never straddles two groups) or a multiple of 128."""
    g = int(group_size)
    if g % 32 != 0 or (g < TILE_K and TILE_K % g != 0):
        raise ValueError(f"{who}: group size {g} must be a multiple of 32 dividing 128, or a multiple of 128")


def pack_for_triton(qweight: QuantizedWeight, device: torch.device | str | None = None, scale_dtype: torch.dtype | None = None) -> TritonInt4Weight:
    """QuantizedWeight (codes [N, K], scales/zeros [N, K/g]) -> TritonInt4Weight on `device`
    (default: the codes' device). Pure torch; raises ValueError for codes that do not fit a nibble."""
    g = int(qweight.group_size)
    check_group_size(g, "pack_for_triton")
    codes = qweight.codes.to(torch.int32)
    n, k = codes.shape
    if k % g != 0 or qweight.scales.shape != (n, k // g):
        raise ValueError(f"pack_for_triton: scales {tuple(qweight.scales.shape)} do not match codes {(n, k)} with group {g}")
    unit = TILE_K * g // math.gcd(TILE_K, g)
    k_pad = -(-k // unit) * unit
    pad_groups = (k_pad - k) // g
    if qweight.zeros is None:
        u = codes + 8
        zeros = None
        pad_code = 8
    else:
        u = codes
        zeros = qweight.zeros.to(torch.int32)
        # 4-bit zero points are 0..15 (16 in GPTQ's v1 offset); up to 128 keeps MAGIC + z exact in
        # bf16 for `_int4_mma_kernel`
        if int(zeros.min()) < 0 or int(zeros.max()) > 128:
            raise ValueError("pack_for_triton: zero points must lie in 0..128")
        pad_code = 0
    if int(u.min()) < 0 or int(u.max()) > 15:
        raise ValueError("pack_for_triton: codes outside the INT4 range (symmetric -8..7, zero-point 0..15)")
    if k_pad != k:
        u = torch.cat([u, torch.full((n, k_pad - k), pad_code, dtype=torch.int32, device=u.device)], 1)
    # [N, K_pad] -> [N, T, 4 (slice j), 16 (p), 2 (e)], k = 128t + 32j + 2p + e
    # -> word [T, 16 (p), N] = sum_(j, e) u << 4 (j + 4e)
    u = u.reshape(n, k_pad // TILE_K, 4, 16, 2)
    words = torch.zeros(n, k_pad // TILE_K, 16, dtype=torch.int64, device=u.device)
    for j in range(4):
        for e in range(2):
            words |= u[:, :, j, :, e].to(torch.int64) << (4 * (j + 4 * e))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # reinterpret as signed int32
    packed = words.permute(1, 2, 0).reshape(k_pad // 8, n).contiguous()
    scales = qweight.scales if scale_dtype is None else qweight.scales.to(scale_dtype)
    if pad_groups:
        scales = torch.cat([scales, torch.zeros(n, pad_groups, dtype=scales.dtype, device=scales.device)], 1)
        if zeros is not None:
            zeros = torch.cat([zeros, torch.zeros(n, pad_groups, dtype=zeros.dtype, device=zeros.device)], 1)
    dev = torch.device(device) if device is not None else codes.device
    return TritonInt4Weight(
        qweight=packed.to(dev),
        scales=scales.t().contiguous().to(dev),
        zeros=None if zeros is None else zeros.t().contiguous().to(torch.uint8).to(dev),
        counters=torch.zeros(COUNTER_TILES, dtype=torch.int32, device=dev),
        group_size=g,
        in_features=k,
        out_features=n,
    )


def unpack_codes(packed: TritonInt4Weight) -> torch.Tensor:
    """Inverse layout: the nibbles u [N, K] int32 (u = q + 8 symmetric, u = q zero-point)."""
    words = packed.qweight.to(torch.int64) & 0xFFFFFFFF  # [T*16, N]
    t = words.shape[0] // 16
    words = words.reshape(t, 16, -1)  # [T, p, N]
    nibble = [(words >> (4 * j)) & 0xF for j in range(8)]
    u = torch.stack([torch.stack([nibble[j], nibble[j + 4]], dim=2) for j in range(4)], dim=1)  # [T, j, p, e, N]
    return u.reshape(t * TILE_K, -1).t()[:, : packed.in_features].to(torch.int32).contiguous()


def dequantize_packed(packed: TritonInt4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_hat [N, K] from the packed layout, in float32 then `dtype` (pure torch reference)."""
    u = unpack_codes(packed).to(torch.float32)
    k, g = packed.in_features, packed.group_size
    s = packed.scales.t().to(torch.float32).repeat_interleave(g, 1)[:, :k]
    z = 8.0 if packed.zeros is None else packed.zeros.t().to(torch.float32).repeat_interleave(g, 1)[:, :k]
    return ((u - z) * s).to(dtype)


def reference_matmul(x: torch.Tensor, packed: TritonInt4Weight, bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """Pure-torch int4_matmul: float32 math on the packed layout, result in x.dtype."""
    w = dequantize_packed(packed).to(x.device)
    y = x.to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return silu_mul_interleaved(y.to(x.dtype)) if gated else y.to(x.dtype)


def interleave_columns(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., N] and [..., N] -> [..., 2N] with column 2i = gate's i, 2i + 1 = up's i: a gate/up
    pair's packed buffers (outputs along the last dim) for a GATED product."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def silu_mul_interleaved(y: torch.Tensor) -> torch.Tensor:
    """A GATED product's epilogue in torch: y [..., 2N] (gate and up interleaved) -> silu(gate) *
    up [..., N], in float32 from y's rounded values, rounded once (as the kernel, and as
    inductor fuses an unfused MLP's silu * mul)."""
    gate, up = y[..., 0::2].to(torch.float32), y[..., 1::2].to(torch.float32)
    return (torch.nn.functional.silu(gate) * up).to(y.dtype)
