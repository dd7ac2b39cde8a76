"""The in-memory form every INT4 format unpacks to and packs from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    """One INT4 linear weight, unpacked.

    codes:  [out, in] int8 (or uint8), the integer grid index q of every weight, in
            [qmin, qmax] (symmetric: -8..7; asymmetric/zero-point: 0..15).
    scales: [out, in // group_size] float (fp16/bf16/fp32 exactly as stored in the file).
    zeros:  [out, in // group_size] integer zero points, or None for symmetric.
    Dequantized weight: w_hat = (codes - zeros) * scales, group-wise along `in`.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    bits: int = 4
    bias: torch.Tensor | None = None

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]
