"""compressed-tensors `pack-quantized` INT4 (what llm-compressor writes; public Qwen3.5 W4A16/AWQ).

Per quantized linear `<p>`: `<p>.weight_packed` int32 [out, in/8] (element k of a row at bits
4(k%8).. of word k//8, stored as q + 8), `<p>.weight_scale` [out, in/g] (model dtype),
`<p>.weight_shape` int64 [2], and for asymmetric `<p>.weight_zero_point` int32 [out/8, in/g]
(zero points packed the same way along dim 0). Codes and zero points are signed -8..7 in the
file and w = (q - z) * s; qfd stores symmetric codes as -8..7 and asymmetric codes/zeros
shifted by +8 (0..15), which leaves q - z unchanged (checked against compressed_tensors'
pack_to_int32 / unpack_from_int32 in the tests).
"""

from __future__ import annotations

from typing import Any

import torch

from qfd.errors import QfdError
from qfd.quant.formats._packing import pack_nibbles, unpack_nibbles
from qfd.quant.types import QuantizedWeight

NAME = "compressed-tensors"
MARKER = "weight_packed"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def weight_args(qcfg: dict[str, Any]) -> dict[str, Any]:
    """The `weights` QuantizationArgs of the (single) config group, validated."""
    if qcfg.get("format") != "pack-quantized":
        raise QfdError(f"compressed-tensors format '{qcfg.get('format')}' is not supported; qfd reads pack-quantized INT4")
    groups = qcfg.get("config_groups") or {}
    args = [g.get("weights") for g in groups.values() if g.get("weights")]
    if not args:
        raise QfdError("compressed-tensors quantization_config has no weight quantization group")
    first = args[0]
    if any(a != first for a in args[1:]):
        raise QfdError("compressed-tensors checkpoints with several different weight schemes are not supported")
    if first.get("type", "int") != "int" or first.get("strategy") != "group" or first.get("actorder"):
        raise QfdError(f"compressed-tensors weight scheme {first} is not supported; qfd handles int, group strategy, no act-order")
    return first


def scheme(qcfg: dict[str, Any]) -> tuple[int, int, bool]:
    args = weight_args(qcfg)
    return int(args["num_bits"]), int(args["group_size"]), bool(args.get("symmetric", True))


def unpack(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> QuantizedWeight:
    bits, group_size, symmetric = scheme(qcfg)
    out_features, in_features = (int(v) for v in tensors["weight_shape"].tolist())
    codes = unpack_nibbles(tensors["weight_packed"])[:, :in_features]
    scales = tensors["weight_scale"]
    if symmetric:
        return QuantizedWeight(codes=(codes.to(torch.int16) - 8).to(torch.int8), scales=scales, zeros=None, group_size=group_size, bits=bits)
    zeros = unpack_nibbles(tensors["weight_zero_point"].t().contiguous()).t()[:out_features]
    # file codes/zeros are (nibble - 8); qfd keeps the nibble itself (0..15): same q - z
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros.contiguous(), group_size=group_size, bits=bits)


def pack(qw: QuantizedWeight, qcfg: dict[str, Any], template: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    out_features, in_features = qw.shape
    if qw.symmetric:
        nibbles = qw.codes.to(torch.int16) + 8
    else:
        nibbles = qw.codes
    padded = torch.nn.functional.pad(nibbles.to(torch.uint8), (0, (-in_features) % 32))  # compressed-tensors pads rows to 32
    packed = pack_nibbles(padded)[:, : -(-in_features * 4 // 32)]
    tensors = {
        "weight_packed": packed.contiguous(),
        "weight_scale": qw.scales,
        "weight_shape": template["weight_shape"] if template is not None else torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if not qw.symmetric:
        zeros = torch.nn.functional.pad(qw.zeros.to(torch.uint8).t(), (0, (-out_features) % 32))
        tensors["weight_zero_point"] = pack_nibbles(zeros)[:, : -(-out_features * 4 // 32)].t().contiguous()
    return tensors


def quantization_config(bits: int, group_size: int, symmetric: bool, ignore: list[str]) -> dict[str, Any]:
    """config.json `quantization_config` exactly as compressed-tensors 0.20 writes it
    (ModelCompressor.update_config: version, quant_method, sparsity/transform configs, then
    QuantizationConfig.model_dump(exclude=["quant_method"]))."""
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric, "group_size": group_size, "strategy": "group", "dynamic": False},
                "input_activations": None,
                "output_activations": None,
                "format": None,
            }
        },
        "kv_cache_scheme": None,
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ignore,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "version": _ct_version(),
    }


def _ct_version() -> str:
    try:
        import compressed_tensors

        return compressed_tensors.__version__
    except ImportError:
        return "0.20.1"
