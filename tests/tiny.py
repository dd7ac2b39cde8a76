"""Tiny random checkpoints of each supported family, written as real HF directories.

They build in milliseconds, so tests can check properties (logits match transformers,
rollback, losslessness) on CPU in float32."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3", "qwen3_5")


def tiny_config(family: str, vocab_size: int = 512, **overrides):
    from transformers import LlamaConfig, Qwen3Config, Qwen3_5TextConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(head_dim=16, **common)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if family == "qwen3_5":
        common.setdefault("layer_types", ["linear_attention", "linear_attention", "linear_attention", "full_attention"][: common["num_hidden_layers"]] * max(1, common["num_hidden_layers"] // 4))
        return Qwen3_5TextConfig(
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            partial_rotary_factor=0.25,
            **common,
        )
    raise ValueError(family)


def make_tiny_checkpoint(family: str, path: Path, *, seed: int = 0, vocab_size: int = 512, tokenizer_from: Path | None = None, **overrides) -> Path:
    """Write a random `family` model to `path` (float32 weights). With `tokenizer_from`, copy
    that directory's tokenizer files (vocab_size must then match it)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size=vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF initialises some parameters (norm weights, A_log) to constants; perturb everything so
    # tests cannot pass by accident on symmetric weights.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    if tokenizer_from is not None:
        from qfd.checkpoint import copy_tokenizer_files

        copy_tokenizer_files(tokenizer_from, path)
    return Path(path)
