"""Drafter directories: config.json in the form vLLM's and z-lab's DFlash loaders read,
model.safetensors (drafter weights only: the target's embedding and head are NOT saved), and
the manifest (written by the stage) pinning the target's fingerprint; optionally
draft_vocab.safetensors, token counts for `--draft-vocab` (qfd.draft_vocab; not weights).

config.json: `architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`, the HF Qwen3 layer
fields (num_hidden_layers, hidden_size, heads, head_dim, intermediate_size, rms_norm_eps,
rope_theta / rope_parameters, max_position_embeddings, vocab_size), and
`dflash_config: {mask_token_id, target_layer_ids, block_size}`. A sliding window is written as
HF `layer_types = ["sliding_attention"] * n`, `sliding_window = W`, `use_sliding_window`, and
`dflash_config.causal = false` (vLLM treats sliding layers as causal unless told otherwise;
the DFlash block is bidirectional).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from qfd.checkpoint import CONFIG_NAME, inspect_model_dir, read_json, save_config
from qfd.errors import QfdError
from qfd.manifest import fingerprint, read_manifest

WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"


def hf_config_dict(cfg, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config.json of a drafter with config `cfg` (a DFlashConfig)."""
    n = cfg.num_hidden_layers
    sliding = cfg.sliding_window is not None
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.target_hidden_size,
        "layer_types": ["sliding_attention" if sliding else "full_attention"] * n,
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": n,
        "is_causal": False,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
            "causal": False,
        },
    }
    config.update({k: v for k, v in cfg.extra.items() if k not in config})
    return config


def config_from_hf(config: dict, path: Path | str = "config.json"):
    """A DFlashConfig from a drafter config.json (ours, or z-lab's of the same shape)."""
    from qfd.models.drafter import DFlashConfig

    block = config.get("dflash_config")
    if not isinstance(block, dict):
        raise QfdError(f"{path}: not a DFlash drafter config (no dflash_config block)")
    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in block]
    if missing:
        raise QfdError(f"{path}: dflash_config lacks {', '.join(missing)}")
    layer_types = config.get("layer_types") or []
    sliding = config.get("sliding_window") if ("sliding_attention" in layer_types or config.get("use_sliding_window") or block.get("use_swa")) else None
    sliding = block.get("swa_window_size", sliding)
    rope = config.get("rope_parameters") or {}
    try:
        return DFlashConfig(
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            target_layer_ids=tuple(block["target_layer_ids"]),
            mask_token_id=int(block["mask_token_id"]),
            num_target_layers=config.get("num_target_layers", max(block["target_layer_ids"]) + 4),
            block_size=int(block.get("block_size", config.get("block_size", 16))),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            target_hidden_size=config.get("target_hidden_size"),
            sliding_window=sliding,
            extra={k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config},
        )
    except KeyError as exc:
        raise QfdError(f"{path}: drafter config lacks {exc.args[0]}") from None
    except ValueError as exc:
        raise QfdError(f"{path}: invalid drafter config ({exc})") from None


def read_drafter_config(directory: Path):
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise QfdError(f"{directory} is not a drafter directory: it has no {CONFIG_NAME}")
    return config_from_hf(read_json(path), path)


def save_drafter(drafter, directory: Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors into `directory` (the manifest is the stage's)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = dtype or drafter.fc.weight.dtype
    state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in drafter.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    save_config(hf_config_dict(drafter.cfg, dtype), directory)


def load_drafter(directory: Path, device="cpu", dtype: torch.dtype = torch.float32, sliding_window: int | None | str = "config", fuse: bool = False):
    """A DFlashDrafter from a drafter directory. `sliding_window` overrides the saved window
    (None = full attention) unless left at "config". `fuse`: for inference, stack k/v and
    gate/up into one linear each (`qfd.models.fuse`; off by default: training, SWA
    conversion and GPTQ read the separate modules by name)."""
    from safetensors.torch import load_file

    from qfd.models.drafter import DFlashDrafter

    directory = Path(directory)
    model_dir = inspect_model_dir(directory)
    cfg = config_from_hf(model_dir.config, directory / CONFIG_NAME)
    if sliding_window != "config":
        cfg = cfg.with_(sliding_window=sliding_window)
    drafter = DFlashDrafter(cfg)
    if model_dir.is_quantized:
        # an INT4 drafter (`qfd draft quantize`): Int4Linear layers run the codes directly
        from qfd.quant.int4_load import load_int4_module

        return _fused(_with_draft_vocab(load_int4_module(drafter, directory, device=device, dtype=dtype), directory), fuse)
    state = {}
    for weight in model_dir.weight_files:
        state.update(load_file(str(weight)))
    expected = set(drafter.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise QfdError(f"{directory}: drafter weights do not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    drafter.load_state_dict(state)
    return _fused(_with_draft_vocab(drafter.to(device=device, dtype=dtype).eval(), directory), fuse)


def _fused(drafter, fuse: bool):
    if fuse:
        from qfd.models.fuse import fuse_projections

        fuse_projections(drafter)
    return drafter


def _with_draft_vocab(drafter, directory: Path):
    """Attach the directory's draft-vocabulary counts (None without draft_vocab.safetensors)
    and where it was loaded from: Engine(draft_vocab=N) takes the top N of these counts."""
    from qfd.draft_vocab import load_counts

    drafter.draft_vocab_counts = load_counts(directory, drafter.cfg.vocab_size)
    drafter.source_dir = Path(directory)
    return drafter


def target_shape(target_config: dict) -> dict:
    text = target_config.get("text_config", target_config)
    return {"hidden_size": text["hidden_size"], "vocab_size": text["vocab_size"], "num_hidden_layers": text["num_hidden_layers"]}


def check_compatible(cfg, target_config: dict, where: str = "drafter") -> None:
    """QfdError when a drafter config cannot run on a target (hidden size, vocab, tap layers)."""
    shape = target_shape(target_config)
    problems = []
    if cfg.target_hidden_size != shape["hidden_size"]:
        problems.append(f"target hidden size {shape['hidden_size']} != drafter's {cfg.target_hidden_size}")
    if cfg.hidden_size != shape["hidden_size"]:
        problems.append(f"the drafter's hidden size {cfg.hidden_size} must equal the target's {shape['hidden_size']} (shared embedding and head)")
    if cfg.vocab_size != shape["vocab_size"]:
        problems.append(f"target vocab {shape['vocab_size']} != drafter's {cfg.vocab_size}")
    if max(cfg.target_layer_ids) >= shape["num_hidden_layers"] or cfg.num_target_layers != shape["num_hidden_layers"]:
        problems.append(f"tap layers {list(cfg.target_layer_ids)} were chosen for a {cfg.num_target_layers}-layer target; this one has {shape['num_hidden_layers']}")
    if problems:
        raise QfdError(f"{where} does not fit the target: {'; '.join(problems)}")


def verify_drafter_target(drafter_dir: Path, target_dir: Path, allow_mismatch: bool = False) -> None:
    """Refuse a drafter on a target it was not trained for.

    Shape mismatches (hidden size, vocab, tap layers) always raise QfdError. A target whose
    fingerprint differs from the one pinned in the drafter's manifest (parents role "target")
    raises too, or only warns with `allow_mismatch`."""
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    cfg = read_drafter_config(drafter_dir)
    target_config = read_json(Path(target_dir) / CONFIG_NAME) if (Path(target_dir) / CONFIG_NAME).is_file() else None
    if target_config is None:
        raise QfdError(f"target {target_dir} has no {CONFIG_NAME}")
    check_compatible(cfg, target_config, where=f"drafter {drafter_dir}")
    manifest = read_manifest(drafter_dir) or {}
    pinned = next((p for p in manifest.get("parents", []) if p.get("role") == "target"), None)
    if pinned is None:
        message = f"drafter {drafter_dir} pins no target fingerprint (no qfd.json with a target parent); cannot check it matches {target_dir}"
    else:
        actual = fingerprint(target_dir)
        if actual == pinned.get("fingerprint"):
            return
        message = f"drafter {drafter_dir} was trained against target {pinned.get('path')} (fingerprint {pinned.get('fingerprint')}), not {target_dir} (fingerprint {actual})"
    if not allow_mismatch:
        raise QfdError(message + "; pass the matching target, or allow the mismatch explicitly")
    warnings.warn(message, stacklevel=2)
    from qfd.console import console

    console.print(f"[bold yellow]warning:[/bold yellow] {message}", highlight=False, soft_wrap=True)
