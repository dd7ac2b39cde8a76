"""`qfd export vllm`: a target + drafter directory that vLLM serves with DFlash."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer, subapps: dict[str, typer.Typer]) -> None:
    export = subapps["export"]

    @export.command("vllm")
    def vllm(
        target: str = typer.Option(..., "--target", help="The INT4 (or BF16) target directory the drafter was trained against."),
        drafter: Path = typer.Option(..., "--drafter", help="The DFlash drafter directory (BF16 or INT4, with or without SWA)."),
        out: Path = typer.Option(..., "--out", help="Output directory: target/, drafter/, serve.sh, speculative_config.json."),
        max_model_len: int = typer.Option(8192, "--max-model-len", help="--max-model-len written into serve.sh."),
        port: int = typer.Option(8000, "--port", help="Port written into serve.sh."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished --out."),
        allow_target_mismatch: bool = typer.Option(False, "--allow-target-mismatch", help="Export even if the drafter pins another target's fingerprint (warns)."),
    ) -> None:
        """Write a directory vLLM loads (compressed-tensors INT4 target + DFlash drafter) and a
        ready `vllm serve` command with the speculative config."""
        from qfd.console import stdout
        from qfd.stages.export_vllm import ExportConfig, run

        path = run(ExportConfig(target=target, drafter=drafter, out=out, max_model_len=max_model_len, port=port, overwrite=overwrite, allow_target_mismatch=allow_target_mismatch))
        stdout.print(f"[green]vLLM export written to[/green] {path}")
        stdout.print(f"serve it with: [bold]{path / 'serve.sh'}[/bold]")
