"""Nibble packing shared by the formats: 8 x 4-bit values per int32, nibble i at bits 4i..4i+3.

All functions work on the last dimension and keep int32 bit patterns exact (the sign bit is
just bit 31: packing goes through int64 and wraps back)."""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i holds column 8j + AWQ_ORDER[i]


def unpack_nibbles(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8n]. `order[i]` = position (within each group of 8 outputs)
    that nibble i holds; None = sequential (nibble i -> position i)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., n, 8], nibble i at index i
    if order is not None:
        inverse = [order.index(pos) for pos in range(8)]  # position -> nibble holding it
        nibbles = nibbles[..., inverse]
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.uint8)


def pack_nibbles(values: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """uint8/int [..., 8n] with values 0..15 -> int32 [..., n] (inverse of unpack_nibbles)."""
    if values.shape[-1] % 8:
        raise ValueError(f"last dimension {values.shape[-1]} is not a multiple of 8")
    v = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    if int(v.min()) < 0 or int(v.max()) > 15:
        raise ValueError("values to pack must lie in 0..15")
    if order is not None:
        v = v[..., list(order)]  # nibble i takes position order[i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    word = (v << shifts).sum(-1)  # < 2^32, no overlap between nibbles
    word = torch.where(word >= (1 << 31), word - (1 << 32), word)
    return word.to(torch.int32)
