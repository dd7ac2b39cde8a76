"""What vLLM's loaders expect of a target + DFlash drafter pair, as checks.

Field and tensor names follow vLLM's `qwen3_dflash.py` (DFlashQwen3ForCausalLM: drafter
tensors `layers.{i}.self_attn.{q,k,v,o}_proj`, `{q,k}_norm`, `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`, plus `fc`, `hidden_norm`, `norm`; the target's
embedding and LM head are shared, not shipped; `dflash_config.{mask_token_id,
target_layer_ids}`; a sliding window as `layer_types` = all "sliding_attention" +
`sliding_window`, with `dflash_config.causal = false` since vLLM otherwise treats sliding
layers as causal) and its compressed-tensors loader (`pack-quantized`: `weight_packed`,
`weight_scale`, `weight_shape`, `weight_zero_point` when asymmetric).
"""

from __future__ import annotations

import json
from pathlib import Path

from qfd.checkpoint import weight_files
from qfd.errors import QfdError

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
LAYER_TENSORS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
LAYER_NORMS = ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm")
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


def tensor_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in weight_files(directory):  # not draft_vocab.safetensors (token counts)
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def _linear_names(prefix: str, quantized: bool, symmetric: bool) -> set[str]:
    if not quantized:
        return {f"{prefix}.weight"}
    names = {f"{prefix}.{suffix}" for suffix in PACKED_SUFFIXES}
    return names if symmetric else names | {f"{prefix}.weight_zero_point"}


def _scheme(config: dict) -> tuple[bool, bool]:
    """(quantized, symmetric) from a config's quantization_config (compressed-tensors only)."""
    qcfg = config.get("quantization_config")
    if not qcfg:
        return False, True
    if qcfg.get("quant_method") != "compressed-tensors" or qcfg.get("format") != "pack-quantized":
        raise QfdError(f"vLLM export needs compressed-tensors pack-quantized INT4, found {qcfg.get('quant_method')}/{qcfg.get('format')}")
    weights = next(iter(qcfg["config_groups"].values()))["weights"]
    return True, bool(weights.get("symmetric", True))


def drafter_problems(directory: Path) -> list[str]:
    """Everything about a drafter directory that vLLM's DFlash loader would reject."""
    config = json.loads((Path(directory) / "config.json").read_text())
    problems = []
    if DRAFTER_ARCHITECTURE not in (config.get("architectures") or []):
        problems.append(f"architectures must include {DRAFTER_ARCHITECTURE}")
    block = config.get("dflash_config") or {}
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in block:
            problems.append(f"dflash_config.{key} missing")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "vocab_size", "max_position_embeddings"):
        if key not in config:
            problems.append(f"config field {key} missing")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if len(set(layer_types)) > 1:
            problems.append("mixed layer_types are not supported by vLLM's DFlash loader")
        if "sliding_attention" in layer_types:
            if not config.get("sliding_window"):
                problems.append("sliding_attention layers need sliding_window")
            if block.get("causal") is not False:
                problems.append("a sliding-window DFlash drafter must set dflash_config.causal = false")
    if problems:
        return problems
    quantized, symmetric = _scheme(config)
    ignored = set((config.get("quantization_config") or {}).get("ignore") or [])
    actual = tensor_names(directory)
    expected = {"hidden_norm.weight", "norm.weight"}
    linears = ["fc"] + [f"layers.{i}.{name}" for i in range(config["num_hidden_layers"]) for name in LAYER_TENSORS]
    for prefix in linears:
        packed = quantized and prefix not in ignored
        expected |= _linear_names(prefix, packed, symmetric)
    for i in range(config["num_hidden_layers"]):
        expected |= {f"layers.{i}.{name}.weight" for name in LAYER_NORMS}
    missing, unexpected = sorted(expected - actual), sorted(actual - expected)
    if missing:
        problems.append(f"missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:4]}{'...' if len(unexpected) > 4 else ''}")
    return problems


def target_problems(directory: Path) -> list[str]:
    """What vLLM's compressed-tensors loader would reject in an INT4 target directory."""
    config = json.loads((Path(directory) / "config.json").read_text())
    try:
        quantized, symmetric = _scheme(config)
    except QfdError as exc:
        return [str(exc)]
    if not quantized:
        return []
    names = tensor_names(directory)
    prefixes = {n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed")}
    if not prefixes:
        return ["no weight_packed tensors"]
    problems = []
    for prefix in sorted(prefixes):
        missing = _linear_names(prefix, True, symmetric) - names
        if missing:
            problems.append(f"{prefix}: missing {sorted(missing)}")
        if f"{prefix}.weight" in names:
            problems.append(f"{prefix}: both dense and packed weights")
    return problems
