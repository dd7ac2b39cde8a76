"""GPTQ v1 INT4 as gptqmodel writes it (checkpoint_format "gptq").

Per quantized linear `<p>`: `<p>.qweight` int32 [in/8, out] packed along the INPUT dimension
(nibble i of row r holds input 8r + i), `<p>.qzeros` int32 [in/g, out/8] packed along the
output dimension, `<p>.scales` fp16 [in/g, out], `<p>.g_idx` int32 [in] (group of each input
column). v1 stores zero points minus one: a symmetric checkpoint has z = 8 stored as 7
(0x77777777 words); the real zero point is nibble + 1. qfd keeps the real zero point (1..16),
so (q - z) * s is the dequantized weight and repacking writes (z - 1) & 0xF back bit-exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from qfd.errors import QfdError
from qfd.quant.formats._packing import pack_nibbles, unpack_nibbles
from qfd.quant.types import QuantizedWeight

NAME = "gptq"
MARKER = "qweight"
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def scheme(qcfg: dict[str, Any]) -> tuple[int, int, bool]:
    fmt = str(qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))).lower()
    if fmt != "gptq":
        raise QfdError(f"GPTQ checkpoint format '{fmt}' is not supported; qfd reads GPTQ v1 ('gptq')")
    if qcfg.get("desc_act"):
        raise QfdError("GPTQ checkpoints with desc_act (act-order) are not supported; re-quantize with desc_act=False")
    return int(qcfg.get("bits", 4)), int(qcfg.get("group_size", 128)), bool(qcfg.get("sym", True))


def unpack(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> QuantizedWeight:
    bits, group_size, _ = scheme(qcfg)
    codes = unpack_nibbles(tensors["qweight"].t().contiguous()).contiguous()  # [out, in]
    in_features = codes.shape[1]
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(in_features) // group_size):
        raise QfdError("GPTQ g_idx is not the plain column // group_size (act-order); not supported")
    zeros = (unpack_nibbles(tensors["qzeros"]).to(torch.int16) + 1).t().contiguous()  # v1: stored z - 1
    scales = tensors["scales"].t().contiguous()
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, group_size=group_size, bits=bits)


def pack(qw: QuantizedWeight, qcfg: dict[str, Any], template: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if qw.zeros is None:  # a symmetric grid in v1 is z = 8 everywhere, codes shifted to 0..15
        codes, zeros = (qw.codes.to(torch.int16) + 8), torch.full(qw.scales.shape, 8, dtype=torch.int16)
    else:
        codes, zeros = qw.codes, qw.zeros
    out_features, in_features = qw.shape
    g_idx = template["g_idx"] if template is not None and "g_idx" in template else (torch.arange(in_features, dtype=torch.int32) // qw.group_size)
    return {
        "qweight": pack_nibbles(codes).t().contiguous(),
        "qzeros": pack_nibbles(((zeros.to(torch.int16) - 1) & 0xF).t()).contiguous(),
        "scales": qw.scales.t().contiguous(),
        "g_idx": g_idx,
    }


def quantization_config(bits: int, group_size: int, symmetric: bool, ignore: list[str]) -> dict[str, Any]:
    """config.json `quantization_config` as gptqmodel 7.6 writes GPTQ v1 (meta omitted)."""
    return {
        "bits": bits,
        "checkpoint_format": "gptq",
        "desc_act": False,
        "format": "gptq",
        "group_size": group_size,
        "lm_head": False,
        "method": "gptq",
        "pack_dtype": "int32",
        "quant_method": "gptq",
        "sym": symmetric,
    }
