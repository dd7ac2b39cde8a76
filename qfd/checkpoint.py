"""Checkpoint directories: the only module that knows file names.

A model spec is a built-in name (`smollm2-135m`), a local directory, or a hub id where the hub
is reachable. Every directory qfd writes is staged in `<out>.partial/` (where an interrupted
stage also keeps its resumable state) and renamed into place only after its manifest is
written, so a complete-looking directory is never half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qfd.errors import QfdError
from qfd.manifest import MANIFEST_NAME, read_manifest, write_manifest

CONFIG_NAME = "config.json"
# A drafter directory's token counts for `--draft-vocab` (qfd.draft_vocab): a safetensors file
# that holds no weights, so every listing of weight files leaves it out (`weight_files`).
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"
NOT_WEIGHTS = (DRAFT_VOCAB_NAME,)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)
# HF architecture name -> qfd family. Qwen3.5's full checkpoint nests the text model.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
}


@dataclass(frozen=True)
class ModelDir:
    """A validated model directory."""

    path: Path
    config: dict[str, Any]
    family: str
    weight_files: tuple[Path, ...]

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        return self.config.get("quantization_config")

    @property
    def is_quantized(self) -> bool:
        return self.quantization_config is not None

    @property
    def manifest(self) -> dict[str, Any] | None:
        return read_manifest(self.path)


def resolve_model(spec: str | Path) -> ModelDir:
    """Turn a built-in name, a local directory or a hub id into a validated ModelDir."""
    from qfd import embedded

    text = str(spec)
    if text in embedded.BUILTIN_MODELS:
        return inspect_model_dir(embedded.ensure_embedded(text))
    path = Path(text).expanduser()
    if path.exists():
        return inspect_model_dir(path)
    if _looks_like_hub_id(text):
        return inspect_model_dir(_download_from_hub(text))
    if os.sep in text or text.startswith((".", "~")):
        raise QfdError(f"model directory {path} does not exist")
    known = ", ".join(sorted(embedded.BUILTIN_MODELS))
    raise QfdError(f"unknown model '{text}': give a model directory, a hub id (org/name), or a built-in name ({known})")


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:  # offline, unknown repo, auth: all one user-facing message
        raise QfdError(f"'{repo_id}' is not a local directory and could not be fetched from the hub ({type(exc).__name__}); pass a local model directory") from None


def inspect_model_dir(path: Path) -> ModelDir:
    """Validate that `path` is a loadable model directory of a supported architecture."""
    path = Path(path).expanduser()
    if not path.exists():
        raise QfdError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise QfdError(f"{path} is a file, not a model directory")
    if not any(path.iterdir()):
        raise QfdError(f"model directory {path} is empty")
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise QfdError(f"{path} is not a model directory: it has no {CONFIG_NAME}")
    config = read_json(config_path)
    architectures = config.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if family is None and config.get("dflash_config") is None:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise QfdError(f"{path}: unsupported architecture {architectures or '(none given)'}; qfd supports {supported}")
    weights = weight_files(path)
    if not weights:
        raise QfdError(f"{path} has no *.safetensors weights (convert .bin checkpoints with transformers' save_pretrained)")
    for weight in weights:
        check_safetensors(weight)
    return ModelDir(path=path.resolve(), config=config, family=family or "dflash", weight_files=weights)


def weight_files(directory: Path) -> tuple[Path, ...]:
    """The *.safetensors weight files of a directory, sorted; side files (NOT_WEIGHTS) left out."""
    return tuple(p for p in sorted(Path(directory).glob("*.safetensors")) if p.name not in NOT_WEIGHTS)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise QfdError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def check_safetensors(path: Path) -> None:
    """Cheap integrity check: the header parses and the file is as long as it says."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError
            header = json.loads(handle.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError):
        raise QfdError(f"{path} is not a valid safetensors file (truncated or corrupt); re-copy or re-create it") from None
    end = max((meta["data_offsets"][1] for name, meta in header.items() if name != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise QfdError(f"{path} is truncated: {size} bytes on disk, {8 + header_len + end} expected; re-copy or re-create it")


def copy_tokenizer_files(source: Path, destination: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(destination) / name)


class Staging:
    """Write a checkpoint into `<out>.partial/`, then `commit()` renames it to `<out>`.

    An existing `.partial` directory is kept (it holds the resumable state of an interrupted
    run) unless `fresh=True`. A completed `<out>` is never overwritten without `overwrite`."""

    def __init__(self, out: Path, *, overwrite: bool = False, fresh: bool = False):
        self.out = Path(out).expanduser().resolve()
        self.path = self.out.with_name(self.out.name + ".partial")
        if self.out.exists():
            if read_manifest(self.out) is None and any(self.out.iterdir()):
                raise QfdError(f"{self.out} exists and is not a qfd checkpoint; refusing to overwrite it, choose another --out")
            if read_manifest(self.out) is not None and not overwrite:
                raise QfdError(f"{self.out} already holds a finished checkpoint; pass --overwrite or choose another --out")
        if fresh and self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def resumed(self) -> bool:
        """True when the staging directory already held something from an earlier run."""
        return any(p.name != ".lock" for p in self.path.iterdir())

    def state_dir(self) -> Path:
        """Where resumable training state lives; removed before commit."""
        state = self.path / "_state"
        state.mkdir(exist_ok=True)
        return state

    def commit(self, keep_state: bool = False, **manifest_fields: Any) -> Path:
        """Drop the resumable state (keep_state: move it to a fresh `<out>.partial/_state`, for
        a run that stopped early and may be continued), write the manifest last, and rename
        into place."""
        state = self.path / "_state"
        kept = self.out.with_name(self.out.name + ".state")
        shutil.rmtree(kept, ignore_errors=True)
        if keep_state and state.is_dir():
            os.replace(state, kept)
        shutil.rmtree(state, ignore_errors=True)
        write_manifest(self.path, **manifest_fields)
        if self.out.exists():
            trash = self.out.with_name(self.out.name + ".old")
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(self.out, trash)
            os.replace(self.path, self.out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.path, self.out)
        if kept.is_dir():
            self.path.mkdir()
            os.replace(kept, self.path / "_state")
        return self.out


def save_config(config: dict[str, Any], directory: Path) -> None:
    (Path(directory) / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def manifest_path(directory: Path) -> Path:
    return Path(directory) / MANIFEST_NAME
