"""`qfd info DIR`: the manifest of a checkpoint directory and its lineage tree."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, subapps: dict[str, typer.Typer]) -> None:
    @app.command()
    def info(
        directory: Path = typer.Argument(..., help="A checkpoint directory (qfd-written or plain HF)."),
        verify: bool = typer.Option(False, "--verify", help="Re-hash every file against the manifest."),
        json_out: bool = typer.Option(False, "--json", help="Print the raw manifest as JSON."),
    ) -> None:
        """Show a checkpoint's manifest (stage, config, metrics, files) and its lineage tree."""
        from qfd.stages.info import run

        run(directory, verify=verify, json_out=json_out)
