"""AutoAWQ GEMM INT4 (as AutoAWQ and gptqmodel FORMAT.GEMM write it).

Per quantized linear `<p>`: `<p>.qweight` int32 [in, out/8] and `<p>.qzeros` int32
[in/g, out/8], both packed along the OUTPUT dimension in AWQ's interleaved order (nibble i of
word j holds output 8j + [0,2,4,6,1,3,5,7][i]); `<p>.scales` [in/g, out] (fp16 from AutoAWQ,
the model dtype from gptqmodel). Codes and zero points are 0..15, w = (q - z) * s, no -1 offset.
AWQ folds its activation scaling into the preceding norms/linears, so those tensors must come
from the AWQ checkpoint too.
"""

from __future__ import annotations

from typing import Any

import torch

from qfd.errors import QfdError
from qfd.quant.formats._packing import AWQ_ORDER, pack_nibbles, unpack_nibbles
from qfd.quant.types import QuantizedWeight

NAME = "awq"
MARKER = "qweight"
SUFFIXES = ("qweight", "qzeros", "scales")


def scheme(qcfg: dict[str, Any]) -> tuple[int, int, bool]:
    version = str(qcfg.get("version", qcfg.get("format", "gemm"))).lower()
    if version != "gemm":
        raise QfdError(f"AWQ version '{version}' is not supported; qfd reads AutoAWQ GEMM checkpoints")
    if qcfg.get("zero_point", True) is False:
        raise QfdError("AWQ checkpoints without zero points are not supported")
    return int(qcfg.get("bits", qcfg.get("w_bit", 4))), int(qcfg.get("group_size", qcfg.get("q_group_size", 128))), False


def unpack(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> QuantizedWeight:
    bits, group_size, _ = scheme(qcfg)
    codes = unpack_nibbles(tensors["qweight"], AWQ_ORDER).t().contiguous()  # [out, in]
    zeros = unpack_nibbles(tensors["qzeros"], AWQ_ORDER).t().contiguous()  # [out, in/g]
    scales = tensors["scales"].t().contiguous()
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, group_size=group_size, bits=bits)


def pack(qw: QuantizedWeight, qcfg: dict[str, Any], template: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if qw.zeros is None:
        raise ValueError("AWQ GEMM needs zero points")
    return {
        "qweight": pack_nibbles(qw.codes.t(), AWQ_ORDER).contiguous(),
        "qzeros": pack_nibbles(qw.zeros.t(), AWQ_ORDER).contiguous(),
        "scales": qw.scales.t().contiguous(),
    }


def quantization_config(bits: int, group_size: int, symmetric: bool, ignore: list[str]) -> dict[str, Any]:
    """config.json `quantization_config` as gptqmodel 7.6 writes AWQ GEMM (meta omitted)."""
    if symmetric:
        raise QfdError("AWQ GEMM stores zero points: use --method awq/rtn with the asymmetric grid, or --format compressed-tensors for symmetric")
    return {
        "bits": bits,
        "checkpoint_format": "gemm",
        "desc_act": False,
        "format": "gemm",
        "group_size": group_size,
        "lm_head": False,
        "method": "awq",
        "pack_dtype": "int32",
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": ignore,
    }
