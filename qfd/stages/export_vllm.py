"""`qfd export vllm`: a directory vLLM serves with native DFlash speculative decoding.

Layout: `target/` (the INT4 target in compressed-tensors pack-quantized, converted from
AWQ/GPTQ if needed, or a plain BF16 target as-is), `drafter/` (the DFlash drafter: config
fields and tensor names as vLLM's loader reads them), `serve.sh` (a ready `vllm serve`
command with the speculative config) and `speculative_config.json`.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from qfd.checkpoint import DRAFT_VOCAB_NAME, Staging, copy_tokenizer_files, inspect_model_dir, resolve_model
from qfd.errors import QfdError
from qfd.vllm_layout import drafter_problems, target_problems


@dataclass(frozen=True)
class ExportConfig:
    target: str
    drafter: Path
    out: Path
    max_model_len: int = 8192
    port: int = 8000
    overwrite: bool = False
    allow_target_mismatch: bool = False


def speculative_config(drafter_config: dict, drafter_path: str) -> dict:
    block = drafter_config["dflash_config"]
    return {
        "method": "dflash",
        "model": drafter_path,
        # one block drafts block_size - 1 tokens (slot 0 is the last committed token)
        "num_speculative_tokens": int(block.get("block_size", drafter_config.get("block_size", 16))) - 1,
    }


def run(cfg: ExportConfig) -> Path:
    from qfd.models.drafter_io import verify_drafter_target

    target = resolve_model(cfg.target)
    drafter = inspect_model_dir(Path(cfg.drafter))
    if drafter.family != "dflash":
        raise QfdError(f"{cfg.drafter} is not a DFlash drafter directory (no dflash_config in config.json)")
    verify_drafter_target(drafter.path, target.path, allow_mismatch=cfg.allow_target_mismatch)
    problems = drafter_problems(drafter.path)
    if problems:
        raise QfdError(f"drafter {drafter.path} would not load in vLLM: {'; '.join(problems)}")

    staging = Staging(cfg.out, overwrite=cfg.overwrite, fresh=True)
    target_out, drafter_out = staging.path / "target", staging.path / "drafter"
    converted = _write_target(target, target_out)
    shutil.copytree(drafter.path, drafter_out, ignore=shutil.ignore_patterns("qfd.json", DRAFT_VOCAB_NAME))  # vLLM would load the counts as weights
    problems = target_problems(target_out) + drafter_problems(drafter_out)
    if problems:
        raise QfdError(f"exported files would not load in vLLM: {'; '.join(problems)}")

    spec = speculative_config(drafter.config, "./drafter")
    (staging.path / "speculative_config.json").write_text(json.dumps(spec, indent=2) + "\n")
    command = [
        "vllm", "serve", "./target",
        "--speculative-config", json.dumps(spec, separators=(",", ":")),
        "--max-model-len", str(cfg.max_model_len),
        "--port", str(cfg.port),
    ]
    script = "#!/usr/bin/env bash\n# Serve the exported target with its DFlash drafter (vLLM with DFlash support).\nset -euo pipefail\ncd \"$(dirname \"$0\")\"\nexec " + " ".join(shlex.quote(c) for c in command) + " \"$@\"\n"
    (staging.path / "serve.sh").write_text(script)
    (staging.path / "serve.sh").chmod(0o755)
    return staging.commit(
        stage="export-vllm",
        parents={"target": target.path, "drafter": drafter.path},
        config={**{k: str(v) for k, v in asdict(cfg).items()}, "target_converted": converted},
        metrics={"num_speculative_tokens": spec["num_speculative_tokens"]},
    )


def _write_target(target, out: Path) -> str:
    """Copy (or convert to compressed-tensors) the target; returns what was done."""
    from qfd.quant.formats import detect_format

    fmt = detect_format(target.config)
    if fmt in (None, "compressed-tensors"):
        shutil.copytree(target.path, out, ignore=shutil.ignore_patterns("qfd.json", "*.partial"))
        return "copied" if fmt else "copied (bf16, not quantized)"
    from qfd.quant.formats import build_checkpoint, format_scheme, load_quantized, save_quantized

    bits, group_size, symmetric = format_scheme(target.config)
    source = load_quantized(target.path)
    config = {k: v for k, v in source.config.items() if k != "quantization_config"}
    ckpt = build_checkpoint("compressed-tensors", config, source.other, source.qweights, bits=bits, group_size=group_size, symmetric=symmetric)
    save_quantized(out, ckpt)
    copy_tokenizer_files(target.path, out)
    return f"converted {fmt} -> compressed-tensors"
