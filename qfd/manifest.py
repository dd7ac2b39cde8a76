"""The `qfd.json` manifest: what made a checkpoint directory, from what, and what it measured.

A directory is complete only when its manifest exists; the manifest is written last and
atomically (tmp file + rename), so a half-written directory is never taken for complete.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

MANIFEST_NAME = "qfd.json"
# Files that describe weights; a plain HF directory is fingerprinted over these.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory` (relative POSIX paths), the manifest excluded."""
    hashes = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST_NAME:
            hashes[path.relative_to(directory).as_posix()] = sha256_file(path)
    return hashes


def _digest_of(hashes: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(hashes):
        digest.update(f"{name}\0{hashes[name]}\n".encode())
    return digest.hexdigest()[:16]


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def fingerprint(directory: Path) -> str:
    """A short content hash identifying a model directory.

    qfd directories carry it in their manifest; for a plain HF directory it is computed over
    config.json and the weight files (which can take seconds for multi-GB weights)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest and "fingerprint" in manifest:
        return manifest["fingerprint"]
    hashes = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and (path.name == "config.json" or path.suffix in _WEIGHT_SUFFIXES):
            hashes[path.name] = sha256_file(path)
    return _digest_of(hashes)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "qfd": _qfd_version()}
    for name in ("torch", "transformers", "gptqmodel", "lm_eval"):
        module = sys.modules.get(name)
        if module is not None:
            found[name] = getattr(module, "__version__", "unknown")
    return found


def _qfd_version() -> str:
    from qfd import __version__

    return __version__


def parent_entry(role: str, directory: Path) -> dict[str, Any]:
    """How a manifest names an input: role, absolute path, fingerprint and its stage."""
    directory = Path(directory).resolve()
    manifest = read_manifest(directory) or {}
    return {
        "role": role,
        "path": str(directory),
        "fingerprint": fingerprint(directory),
        "stage": manifest.get("stage", "external"),
    }


def write_manifest(
    directory: Path,
    *,
    stage: str,
    parents: dict[str, Path | dict] | None = None,
    config: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """Hash every file in `directory`, then write `qfd.json` atomically. Call it last.
    `parents` maps a role to an input directory, or to a parent entry carried over from another
    manifest as it was recorded (e.g. a pin whose directory is on another machine)."""
    directory = Path(directory)
    hashes = file_hashes(directory)
    manifest = {
        "format": "qfd-checkpoint/1",
        "stage": stage,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else sys.argv,
        "parents": [{**path, "role": role} if isinstance(path, dict) else parent_entry(role, path) for role, path in (parents or {}).items()],
        "config": config or {},
        "metrics": metrics or {},
        "files": hashes,
        "fingerprint": _digest_of(hashes),
        "versions": versions(),
    }
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    os.replace(tmp, directory / MANIFEST_NAME)
    return manifest


def verify_files(directory: Path, manifest: dict[str, Any], deep: bool = False) -> list[str]:
    """Problems with the files a manifest lists: missing ones, and with `deep` wrong hashes."""
    problems = []
    for name, digest in manifest.get("files", {}).items():
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"missing {name}")
        elif deep and sha256_file(path) != digest:
            problems.append(f"hash mismatch {name}")
    return problems


def is_complete(directory: Path, stage: str | None = None, deep: bool = False) -> bool:
    """True when `directory` holds a finished qfd checkpoint (of `stage`, if given)."""
    manifest = read_manifest(Path(directory))
    if manifest is None or (stage is not None and manifest.get("stage") != stage):
        return False
    return not verify_files(Path(directory), manifest, deep=deep)
