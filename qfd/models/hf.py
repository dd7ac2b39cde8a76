"""transformers models of plain and INT4 directories, for training (QAD student/teacher,
drafter target features).

An INT4 directory (compressed-tensors / AWQ GEMM / GPTQ v1) is built as a dense model whose
quantized linears hold the dequantized INT4 weights and whose other tensors (norms, embeddings:
AWQ folds its scaling into norms) come from the INT4 checkpoint itself (method.md section 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qfd.checkpoint import ModelDir, inspect_model_dir
from qfd.errors import QfdError


def _as_model_dir(model: str | Path | ModelDir) -> ModelDir:
    if isinstance(model, ModelDir):
        return model
    from qfd.checkpoint import resolve_model

    return resolve_model(model)


def dense_config(model_dir: ModelDir) -> Any:
    """The transformers config of `model_dir` without its quantization_config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def load_hf_causal_lm(model: str | Path | ModelDir, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, ckpt=None):
    """A transformers causal LM of `model` (plain or INT4) on `device` in `dtype`, eval mode.

    `ckpt`: an already loaded QuantizedCheckpoint of the same directory (saves a second read)."""
    from transformers import AutoModelForCausalLM

    model_dir = _as_model_dir(model)
    if not model_dir.is_quantized:
        loaded = AutoModelForCausalLM.from_pretrained(model_dir.path, dtype=dtype)
        return loaded.to(device).eval()
    from qfd.quant.formats import load_quantized

    ckpt = ckpt if ckpt is not None else load_quantized(model_dir.path)
    loaded = AutoModelForCausalLM.from_config(dense_config(model_dir), dtype=dtype)
    state = ckpt.dequantized_state_dict(dtype)
    missing, unexpected = loaded.load_state_dict(state, strict=False)
    tied = {name for name in missing if name.endswith("lm_head.weight") and getattr(loaded.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise QfdError(f"{model_dir.path}: INT4 tensors do not match the architecture (missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    if tied:
        loaded.tie_weights()
    return loaded.to(device).eval()


def load_hf_int4_runtime(model: str | Path | ModelDir, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, ckpt=None):
    """A transformers model of an INT4 directory whose quantized linears execute INT4
    (qfd.quant.int4_linear.Int4Linear): "the INT4 checkpoint itself" for QAD's sanity check."""
    from qfd.quant.formats import load_quantized
    from qfd.quant.int4_linear import swap_int4_linears

    model_dir = _as_model_dir(model)
    ckpt = ckpt if ckpt is not None else load_quantized(model_dir.path)
    loaded = load_hf_causal_lm(model_dir, device, dtype, ckpt=ckpt)
    return swap_int4_linears(loaded, ckpt.qweights)


def load_tokenizer(model: str | Path | ModelDir):
    from transformers import AutoTokenizer

    model_dir = _as_model_dir(model)
    try:
        return AutoTokenizer.from_pretrained(model_dir.path)
    except (OSError, ValueError) as exc:
        raise QfdError(f"{model_dir.path} has no usable tokenizer ({type(exc).__name__}); copy the tokenizer files into it") from None


__all__ = ["load_hf_causal_lm", "load_hf_int4_runtime", "load_tokenizer", "dense_config", "inspect_model_dir"]
