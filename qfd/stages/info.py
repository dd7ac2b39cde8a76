"""Print a checkpoint's manifest and lineage."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table
from rich.tree import Tree

from qfd.checkpoint import inspect_model_dir
from qfd.console import stdout
from qfd.errors import QfdError
from qfd.manifest import fingerprint, read_manifest, verify_files


def run(directory: Path, *, verify: bool = False, json_out: bool = False) -> None:
    directory = Path(directory).expanduser()
    manifest = read_manifest(directory)
    if manifest is None:
        # A plain HF directory is a valid input; say what it is.
        model = inspect_model_dir(directory)
        stdout.print(f"[bold]{model.path}[/bold]: plain {model.family} checkpoint (no qfd.json)")
        stdout.print(f"architectures: {model.config.get('architectures')}, quantized: {model.is_quantized}")
        stdout.print(f"fingerprint: {fingerprint(model.path)}")
        return
    if json_out:
        stdout.print_json(json.dumps(manifest, default=str))
        return
    table = Table(title=f"{directory} ({manifest.get('stage')})", show_header=False)
    for key in ("stage", "created", "fingerprint"):
        table.add_row(key, str(manifest.get(key)))
    table.add_row("command", " ".join(map(str, manifest.get("command", []))))
    table.add_row("versions", ", ".join(f"{k} {v}" for k, v in manifest.get("versions", {}).items()))
    for key, value in manifest.get("metrics", {}).items():
        table.add_row(f"metric {key}", _short(value))
    for key, value in manifest.get("config", {}).items():
        table.add_row(f"config {key}", _short(value))
    table.add_row("files", f"{len(manifest.get('files', {}))} files")
    stdout.print(table)
    stdout.print(lineage_tree(directory))
    if verify:
        problems = verify_files(directory, manifest, deep=True)
        if problems:
            raise QfdError(f"{directory} fails verification: {'; '.join(problems)}")
        stdout.print("[green]all files match the manifest[/green]")


def lineage_tree(directory: Path, _tree: Tree | None = None, _depth: int = 0) -> Tree:
    manifest = read_manifest(directory) or {}
    label = f"[bold]{manifest.get('stage', 'external')}[/bold] {directory} [dim]{manifest.get('fingerprint', '')}[/dim]"
    node = Tree(label) if _tree is None else _tree.add(label)
    for parent in manifest.get("parents", []):
        path = Path(parent["path"])
        if _depth < 12 and read_manifest(path) is not None:
            lineage_tree(path, node.add(f"[cyan]{parent['role']}[/cyan]"), _depth + 1)
        else:
            status = "" if path.exists() else " [red](missing)[/red]"
            node.add(f"[cyan]{parent['role']}[/cyan] {parent.get('stage')} {path} [dim]{parent.get('fingerprint')}[/dim]{status}")
    return node


def _short(value: object, limit: int = 100) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."
