"""Load a checkpoint directory into qfd's runtime TargetModel (+ its tokenizer).

Plain directories load their safetensors as-is (names mirror transformers'). The full
Qwen3.5 checkpoint (`Qwen3_5ForConditionalGeneration`) keeps its text model under
`model.language_model.*`: those names are mapped to `model.*`; the vision tower and the
multi-token-prediction head are ignored. INT4 directories (compressed-tensors, AWQ, GPTQ)
are read by `qfd.quant.formats.load_quantized` and their linears swapped for `Int4Linear`.
Once loaded, same-input projections are fused for inference (`qfd.models.fuse`; `fuse=False` or
QFD_FUSE=0 keeps transformers' module tree, e.g. for code that reads a layer's q_proj).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from qfd.checkpoint import ModelDir, resolve_model
from qfd.errors import QfdError
from qfd.models.fuse import fuse_projections
from qfd.models.target import TargetConfig, TargetModel

# Checkpoint name prefixes -> runtime names (None: ignored, not part of the text model).
PREFIX_MAP = (
    ("model.language_model.", "model."),
    ("model.visual.", None),
    ("visual.", None),
    ("mtp.", None),
)
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def map_name(name: str) -> str | None:
    """Runtime parameter name of a checkpoint tensor, or None if it is not part of the text model."""
    for prefix, replacement in PREFIX_MAP:
        if name.startswith(prefix):
            return None if replacement is None else replacement + name[len(prefix) :]
    return name


def target_config(model_dir: ModelDir) -> TargetConfig:
    if model_dir.family == "dflash":
        raise QfdError(f"{model_dir.path} is a DFlash drafter, not a target model; pass the target directory")
    return TargetConfig.from_hf(model_dir.config, model_dir.family)


def load_target(spec: str | Path | ModelDir, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *, tokenizer: bool = True, fuse: bool = True, int4_head: bool = False, int8_head: bool = False) -> tuple[TargetModel, Any]:
    """(TargetModel in eval mode on `device`, tokenizer or None when the directory has none).
    `fuse`: stack same-input projections into one linear each (`qfd.models.fuse`; QFD_FUSE=0
    turns it off too): fewer kernel launches per step, but no q_proj/gate_proj/... modules.
    `int4_head` (`--int4-head`): RTN INT4 (group 128, else 64 / 32) of the LM head at load, `qfd.quant.head`:
    fewer bytes per decode step, but a slightly different target (bench/bench_int4_head.py).
    `int8_head` (`--int8-head`): the same in INT8 (`qfd.quant.head.Int8Head`): half the bytes saved, ~4x closer logits."""
    if int4_head and int8_head:
        raise QfdError("pass one of --int4-head or --int8-head, not both")
    model_dir = spec if isinstance(spec, ModelDir) else resolve_model(spec)
    cfg = target_config(model_dir)
    device = torch.device(device)
    with torch.device("meta"):
        model = TargetModel(cfg)
    if model_dir.is_quantized:
        state = _load_int4(model, model_dir, device, dtype)
    else:
        state = _read_safetensors(model_dir)
    state = {name: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for name, t in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the head is the embedding
    # what still has to come from the checkpoint (swapped Int4Linear modules hold their own)
    expected = {name for name, t in model.state_dict().items() if t.is_meta}
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    unexpected = sorted(set(state) - expected)
    missing = sorted(expected - set(state))
    if unexpected or missing:
        raise QfdError(f"{model_dir.path}: weights do not match a {cfg.family} model (missing {missing[:3]}, unexpected {unexpected[:3]}); is config.json right for these safetensors?")
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise QfdError(f"{model_dir.path}: a weight has the wrong shape for its config.json ({first})") from None
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device)
    model.reset_rope(device)
    model.eval().requires_grad_(False)
    if fuse:
        fuse_projections(model)
    if int4_head or int8_head:
        from qfd.quant.head import quantize_head

        quantize_head(model, bits=8 if int8_head else 4)
    return model, (load_tokenizer(model_dir) if tokenizer else None)


def _read_safetensors(model_dir: ModelDir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in model_dir.weight_files:
        for name, tensor in load_file(str(path)).items():
            mapped = map_name(name)
            if mapped is not None:
                state[mapped] = tensor
    return state


def _load_int4(model: TargetModel, model_dir: ModelDir, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Swap the quantized linears of `model` for Int4Linear; return the other tensors."""
    try:
        from qfd.quant.formats import load_quantized
        from qfd.quant.int4_linear import swap_int4_linears
    except ImportError as exc:
        raise QfdError(f"INT4 loading is unavailable in this qfd build ({exc}); use a dense checkpoint") from None
    ckpt = load_quantized(model_dir.path)
    other = {mapped: t for name, t in ckpt.other.items() if (mapped := map_name(name)) is not None}
    qweights = {}
    for name, qw in ckpt.qweights.items():
        mapped = map_name(name + ".weight")
        if mapped is None:
            continue
        path = mapped[: -len(".weight")]
        if qw.bias is None and f"{path}.bias" in other:  # a bias stored beside the INT4 tensors
            qw = replace(qw, bias=other[f"{path}.bias"])
        qweights[path] = qw
    modules = dict(model.named_modules())
    not_linear = sorted(p for p in qweights if not isinstance(modules.get(p), torch.nn.Linear))
    if not_linear:
        raise QfdError(f"{model_dir.path}: quantized tensors {not_linear[:3]} name no linear layer of a {model.config.family} model")
    for path in qweights:
        # The model is still on the meta device; swap_int4_linears builds each Int4Linear on
        # the device/dtype of the linear it replaces, so give it an empty real weight to read.
        modules[path].weight = torch.nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)
        modules[path].bias = None
    swap_int4_linears(model, qweights)
    # INT4 biases now belong to the swapped modules
    return {name: t for name, t in other.items() if not (name.endswith(".bias") and name[: -len(".bias")] in qweights)}


def load_tokenizer(model_dir: ModelDir):
    """transformers' tokenizer of the directory, or None when it has no tokenizer files."""
    if not any((model_dir.path / name).is_file() for name in TOKENIZER_MARKERS):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir.path)
    except (OSError, ValueError, KeyError) as exc:
        raise QfdError(f"{model_dir.path}: its tokenizer does not load ({type(exc).__name__}: {str(exc)[:120]}); re-copy the tokenizer files") from None


def stop_token_ids(model_dir: ModelDir, tokenizer=None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer (in that order)."""
    ids: list[int] = []

    def add(value) -> None:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)

    generation = model_dir.path / "generation_config.json"
    if generation.is_file():
        try:
            add(json.loads(generation.read_text()).get("eos_token_id"))
        except json.JSONDecodeError:
            pass
    add(model_dir.config.get("eos_token_id"))
    add((model_dir.config.get("text_config") or {}).get("eos_token_id"))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)
