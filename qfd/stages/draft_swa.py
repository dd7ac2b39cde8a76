"""`qfd draft swa`: sliding-window attention for the drafter (method.md section 3).

The drafter's attention over the TARGET CONTEXT is limited to the last W tokens once the
context is longer than W; inside the block attention stays bidirectional. This is a config
transform written as the fields HF and vLLM read:

- HF (Qwen3-style): `sliding_window = W`, `use_sliding_window = true`,
  `layer_types = ["sliding_attention"] * num_hidden_layers`, `max_window_layers = 0`.
- vLLM's DFlash loader (vllm/model_executor/models/qwen3_dflash.py, `_resolve_layer_attention`):
  a layer is sliding when `layer_types[i] == "sliding_attention"` (or `dflash_config.use_swa`),
  with the window from `dflash_config.swa_window_size` or `sliding_window`. It also treats a
  sliding layer as CAUSAL unless `dflash_config.causal` says otherwise, so we write
  `dflash_config.causal = false` explicitly: the block must stay bidirectional.

qfd's own drafter (qfd.models.drafter, DFlashConfig.sliding_window) reads `sliding_window`.
The weights are copied unchanged (an INT4 drafter stays INT4) unless `train_steps` asks for a
short fine-tune with the window (later DFlash drafters train with it; the paper applied it at
inference only). The manifest records the order of transforms in config.transforms.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qfd.checkpoint import CONFIG_NAME, Staging, inspect_model_dir, read_json, save_config
from qfd.errors import QfdError
from qfd.manifest import MANIFEST_NAME, read_manifest

STAGE = "draft-swa"


@dataclass(frozen=True)
class DraftSwaConfig:
    drafter: Path
    window: int
    out: Path
    train_steps: int = 0
    target: str | None = None
    data: Path | None = None
    lr: float = 3e-4
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    overwrite: bool = False


def drafter_dir(spec: Path | str, flag: str = "--drafter"):
    """A validated drafter directory (config.json with a dflash_config block)."""
    model = inspect_model_dir(Path(spec))
    if model.config.get("dflash_config") is None:
        raise QfdError(f"{flag} {model.path} is not a DFlash drafter (its config.json has no dflash_config); pass a `qfd draft train` output")
    return model


def prior_transforms(directory: Path) -> list[str]:
    """The transforms (quantize / swa) already applied to a drafter, in order, from its manifest."""
    manifest = read_manifest(directory) or {}
    return list((manifest.get("config") or {}).get("transforms") or [])


def with_window(config: dict[str, Any], window: int | None) -> dict[str, Any]:
    """config.json of a drafter with sliding window `window` (None removes it). Pure."""
    config = copy.deepcopy(config)
    layers = int(config.get("num_hidden_layers") or len(config.get("layer_types") or []) or 0)
    dflash = dict(config.get("dflash_config") or {})
    if window is None:
        config["sliding_window"] = None
        config["use_sliding_window"] = False
        if layers:
            config["layer_types"] = ["full_attention"] * layers
        dflash.pop("use_swa", None)
        dflash.pop("swa_window_size", None)
    else:
        config["sliding_window"] = int(window)
        config["use_sliding_window"] = True
        config["max_window_layers"] = 0
        if layers:
            config["layer_types"] = ["sliding_attention"] * layers
        dflash["use_swa"] = True
        dflash["swa_window_size"] = int(window)
    dflash["causal"] = False  # vLLM: sliding layers default to causal otherwise
    config["dflash_config"] = dflash
    return config


def _validate(cfg: DraftSwaConfig):
    if cfg.window < 1:
        raise QfdError(f"--window {cfg.window}: the window must be at least 1 token")
    model = drafter_dir(cfg.drafter)
    block = int(model.config["dflash_config"].get("block_size", 16))
    if cfg.train_steps < 0:
        raise QfdError("--train-steps must be >= 0")
    if cfg.train_steps:
        if model.is_quantized:
            raise QfdError(f"{model.path} is an INT4 drafter: fine-tune the BF16 drafter with the window first (`qfd draft swa --train-steps`), then `qfd draft quantize` it")
        if cfg.target is None or cfg.data is None:
            raise QfdError("--train-steps needs --target and --data (the fine-tune runs the target over target-generated conversations)")
    if Path(cfg.out).expanduser().resolve() == model.path:
        raise QfdError("--out must differ from --drafter: inputs are never modified")
    return model, block


def run(cfg: DraftSwaConfig) -> Path:
    model, block = _validate(cfg)
    from qfd.console import console

    staging = Staging(cfg.out, overwrite=cfg.overwrite, fresh=True)
    for path in model.path.iterdir():
        if path.is_file() and path.name not in (MANIFEST_NAME, CONFIG_NAME) and not path.name.startswith("."):
            shutil.copy2(path, staging.path / path.name)
    config = with_window(model.config, cfg.window)
    save_config(config, staging.path)
    metrics: dict[str, Any] = {}
    if cfg.train_steps:
        metrics.update(_fine_tune(cfg, staging.path))
    if cfg.window < block:
        console.print(f"[yellow]warning:[/yellow] window {cfg.window} is shorter than the block ({block}): the drafter sees little context")
    transforms = prior_transforms(model.path) + ["swa"]
    parents = {"drafter": model.path}
    if cfg.train_steps and cfg.target is not None:
        from qfd.checkpoint import resolve_model

        parents["target"] = resolve_model(cfg.target).path
    return staging.commit(
        stage=STAGE,
        parents=parents,
        config={"window": cfg.window, "train_steps": cfg.train_steps, "lr": cfg.lr, "seed": cfg.seed, "transforms": transforms,
                "quantized": model.is_quantized},
        metrics=metrics,
    )


def _fine_tune(cfg: DraftSwaConfig, directory: Path) -> dict[str, Any]:
    """A short fine-tune of the windowed drafter in `directory` (qfd.drafter_trainer), in place:
    held-out E[tau] with the window before and after, then the weights are re-saved."""
    import torch

    from qfd.checkpoint import resolve_model
    from qfd.data import load_data_dir
    from qfd.device import pick_device, pick_dtype
    from qfd.drafter_trainer import FrozenTarget, TrainConfig, evaluate, prepare_sequences, split_holdout, train_drafter
    from qfd.models.drafter_io import load_drafter, save_drafter, verify_drafter_target
    from qfd.models.hf import load_hf_causal_lm

    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    target_dir = resolve_model(cfg.target)
    verify_drafter_target(Path(cfg.drafter), target_dir.path, allow_mismatch=True)
    records, _ = load_data_dir(Path(cfg.data))
    train_records, eval_records = split_holdout(records, 0.05, 32, cfg.seed)
    # Sequences must be longer than the window for it to matter; keep them whole (up to 8K).
    tcfg = TrainConfig(lr=cfg.lr, steps=cfg.train_steps, grad_accum=1, max_anchors=128 if device.type == "cpu" else 512, max_len=8192, seed=cfg.seed, warmup_frac=0.1)
    train_seqs, eval_seqs = prepare_sequences(train_records, tcfg.max_len), prepare_sequences(eval_records, tcfg.max_len)
    if not train_seqs:
        raise QfdError(f"--data {cfg.data} has no usable conversations for the fine-tune")
    target_model = load_hf_causal_lm(target_dir, device=device, dtype=torch.float32 if device.type == "cpu" else dtype)
    drafter = load_drafter(directory, device=device, dtype=torch.float32)  # fp32 master weights
    target = FrozenTarget(target_model, drafter.cfg.target_layer_ids)
    before = evaluate(drafter, target, eval_seqs) if eval_seqs else {}
    result = train_drafter(drafter, target, train_seqs, tcfg, progress=True)
    after = evaluate(drafter, target, eval_seqs) if eval_seqs else {}
    config = read_json(directory / CONFIG_NAME)
    save_drafter(drafter, directory, dtype=getattr(torch, str(config.get("dtype", "float32"))))
    save_config(config, directory)  # keep the input's config (window fields, extras) verbatim
    return {
        "fine_tune": {"steps": result.get("steps"), "final_train_loss": result.get("final_train_loss"), "train_seconds": result.get("train_seconds")},
        "expected_acceptance_length_before": before.get("expected_acceptance_length"),
        "expected_acceptance_length_after": after.get("expected_acceptance_length"),
    }
