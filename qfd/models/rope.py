"""Rotary position embeddings (RoFormer, arXiv 2104.09864) as transformers computes them.

Supported `rope_type`s: default, linear, llama3 (Llama 3.1). Qwen3.5's multimodal RoPE
(`mrope_section`) reduces to plain RoPE for text, where the temporal, height and width
position ids are all equal, so it needs nothing extra here. Partial rotary (Qwen3.5:
`partial_rotary_factor` 0.25) rotates only the first `rotary_dim` channels of each head.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qfd.errors import QfdError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Keys of rope_parameters that change nothing for text-only decoding.
_IGNORED_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


def inv_frequencies(rotary_dim: int, theta: float, rope: dict[str, Any]) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies for `rope` (an HF rope_parameters dict)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        # transformers' _compute_llama3_parameters: scale long wavelengths, keep short ones,
        # interpolate smoothly in between.
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise QfdError(f"rope type '{kind}' is not supported by qfd's runtime model (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def check_rope(rope: dict[str, Any]) -> None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise QfdError(f"rope type '{kind}' is not supported by qfd's runtime model (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if kind == "default":
        unknown = set(rope) - _IGNORED_KEYS - {"factor", "original_max_position_embeddings"}
        if unknown:
            raise QfdError(f"rope_parameters keys {sorted(unknown)} are not supported by qfd's runtime model")


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rotary_dim] for integer `positions` [T], computed in float32
    (as transformers does) and cast to `dtype`."""
    freqs = positions.float()[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, rotary_dim] with rotary_dim <= head_dim.
    Channels beyond rotary_dim pass through unchanged (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
