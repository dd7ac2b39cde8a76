"""INT4 checkpoint formats: compressed-tensors pack-quantized, AutoAWQ GEMM, GPTQ v1.

Every format unpacks to `QuantizedWeight` per linear (module path as transformers names it)
and packs back bit-exactly: `save_quantized(load_quantized(d))` rewrites every tensor with
identical bytes, and QAD's output keeps each scale / zero-point tensor object it read.

    ckpt = load_quantized(dir)            # QuantizedCheckpoint
    ckpt.qweights["model.layers.0.mlp.up_proj"]  -> QuantizedWeight
    ckpt.other                            # non-quantized tensors (norms, embeddings, biases)
    save_quantized(out, ckpt, qweights=new_codes)   # same format, file layout, config
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from qfd.checkpoint import weight_files
from qfd.errors import QfdError
from qfd.quant.formats import awq, compressed_tensors, gptq
from qfd.quant.grid import check_supported, dequantize
from qfd.quant.types import QuantizedWeight

FORMATS: dict[str, ModuleType] = {"compressed-tensors": compressed_tensors, "awq": awq, "gptq": gptq}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EXTRA_FILES = ("quantize_config.json",)  # gptqmodel writes it next to config.json


def detect_format(config: dict[str, Any]) -> str | None:
    """'compressed-tensors' | 'awq' | 'gptq' for an INT4 config.json, None for a plain model."""
    qcfg = config.get("quantization_config")
    if not qcfg:
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    if method in FORMATS:
        return method
    raise QfdError(f"quantization method '{method}' is not supported; qfd reads {', '.join(FORMATS)} INT4 checkpoints")


def format_scheme(config: dict[str, Any]) -> tuple[int, int, bool]:
    """(bits, group_size, symmetric) of an INT4 config, validated (QfdError if unsupported)."""
    name = detect_format(config)
    if name is None:
        raise QfdError("not a quantized checkpoint (config.json has no quantization_config)")
    bits, group_size, symmetric = FORMATS[name].scheme(config["quantization_config"])
    check_supported(bits, group_size, where=name)
    return bits, group_size, symmetric


@dataclass
class QuantizedCheckpoint:
    """An INT4 checkpoint in memory. `file_of` maps every tensor name to its shard file."""

    format: str
    config: dict[str, Any]
    qweights: dict[str, QuantizedWeight]
    other: dict[str, torch.Tensor]
    templates: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # small per-module tensors kept verbatim (weight_shape, g_idx)
    file_of: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    source: Path | None = None

    @property
    def qcfg(self) -> dict[str, Any]:
        return self.config["quantization_config"]

    def dequantized_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """A dense state dict: `<p>.weight` = dequantized INT4 for quantized linears, the rest as stored."""
        state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in self.other.items()}
        for path, qw in self.qweights.items():
            state[f"{path}.weight"] = dequantize(qw, dtype)
        return state


def load_quantized(directory: str | Path) -> QuantizedCheckpoint:
    """Read an INT4 directory of any supported format into a QuantizedCheckpoint."""
    from safetensors import safe_open

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    name = detect_format(config)
    if name is None:
        raise QfdError(f"{directory} is not an INT4 checkpoint (config.json has no quantization_config); pass an INT4 directory or make one with `qfd quantize`")
    format_scheme(config)
    fmt = FORMATS[name]
    tensors: dict[str, torch.Tensor] = {}
    file_of: dict[str, str] = {}
    metadata: dict[str, dict[str, str]] = {}
    for path in weight_files(directory):  # not draft_vocab.safetensors (token counts)
        with safe_open(str(path), framework="pt") as handle:
            metadata[path.name] = handle.metadata() or {}
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
                file_of[key] = path.name
    prefixes = sorted(key[: -len(fmt.MARKER) - 1] for key in tensors if key.endswith("." + fmt.MARKER))
    if not prefixes:
        raise QfdError(f"{directory}: config says {name} but no '*.{fmt.MARKER}' tensors were found")
    qweights, templates = {}, {}
    for prefix in prefixes:
        parts = {suffix: tensors.pop(f"{prefix}.{suffix}") for suffix in fmt.SUFFIXES if f"{prefix}.{suffix}" in tensors}
        qw = fmt.unpack(parts, config["quantization_config"])
        qw.bias = tensors.get(f"{prefix}.bias")
        qweights[prefix] = qw
        templates[prefix] = {k: v for k, v in parts.items() if k in ("weight_shape", "g_idx")}
    return QuantizedCheckpoint(format=name, config=config, qweights=qweights, other=tensors, templates=templates, file_of=file_of, metadata=metadata, source=directory)


def save_quantized(directory: str | Path, ckpt: QuantizedCheckpoint, qweights: dict[str, QuantizedWeight] | None = None) -> None:
    """Write `ckpt` (with `qweights` replacing its codes, if given) in its own format and file
    layout into `directory`: safetensors shards, config.json, the shard index and gptqmodel's
    quantize_config.json when the source had them. Tokenizer files are the caller's job."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fmt = FORMATS[ckpt.format]
    qweights = qweights if qweights is not None else ckpt.qweights
    if set(qweights) != set(ckpt.qweights):
        raise ValueError("save_quantized: qweights must cover exactly the checkpoint's quantized modules")
    shards: dict[str, dict[str, torch.Tensor]] = {}
    default_file = SINGLE_FILE
    for name, tensor in ckpt.other.items():
        shards.setdefault(ckpt.file_of.get(name, default_file), {})[name] = tensor
    for prefix, qw in qweights.items():
        for suffix, tensor in fmt.pack(qw, ckpt.qcfg, ckpt.templates.get(prefix)).items():
            key = f"{prefix}.{suffix}"
            shards.setdefault(ckpt.file_of.get(key, ckpt.file_of.get(f"{prefix}.{fmt.MARKER}", default_file)), {})[key] = tensor
    for filename, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / filename), metadata=ckpt.metadata.get(filename) or {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(ckpt.config, indent=2, sort_keys=True) + "\n")
    if len(shards) > 1 or (ckpt.source is not None and (ckpt.source / INDEX_NAME).is_file()):
        weight_map = {key: filename for filename, tensors in shards.items() for key in tensors}
        total = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
        (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    if ckpt.source is not None:
        for extra in EXTRA_FILES:
            if (ckpt.source / extra).is_file() and ckpt.source.resolve() != directory.resolve():
                shutil.copy2(ckpt.source / extra, directory / extra)


def build_checkpoint(format_name: str, config: dict[str, Any], dense_state: dict[str, torch.Tensor], qweights: dict[str, QuantizedWeight], *, bits: int, group_size: int, symmetric: bool) -> QuantizedCheckpoint:
    """A new QuantizedCheckpoint from a dense state dict and the quantized linears' QuantizedWeights
    (whose `<p>.weight` entries are dropped from the dense tensors)."""
    if format_name not in FORMATS:
        raise QfdError(f"unknown INT4 format '{format_name}'; use one of {', '.join(FORMATS)}")
    fmt = FORMATS[format_name]
    ignore = {name[: -len(".weight")] for name, t in dense_state.items() if name.endswith(".weight") and t.dim() == 2 and name[: -len(".weight")] not in qweights and "embed" not in name}
    if "lm_head" not in qweights:
        # A tied head has no tensor of its own here, yet it is a Linear: unlisted, loaders
        # (compressed-tensors in transformers, vLLM) would expect it quantized and fail to tie it.
        ignore.add("lm_head")
    ignore = sorted(ignore)
    config = dict(config)
    config["quantization_config"] = fmt.quantization_config(bits, group_size, symmetric, ignore)
    other = {name: t for name, t in dense_state.items() if not (name.endswith(".weight") and name[: -len(".weight")] in qweights)}
    return QuantizedCheckpoint(format=format_name, config=config, qweights=qweights, other=other)


def with_codes(ckpt: QuantizedCheckpoint, qweights: dict[str, QuantizedWeight]) -> QuantizedCheckpoint:
    return replace(ckpt, qweights=qweights)
