"""`qfd all`: the whole pipeline in one resumable command."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, subapps: dict[str, typer.Typer]) -> None:
    @app.command(name="all")
    def all_(
        out: Path = typer.Option(Path("runs/demo"), "--out", help="Pipeline directory: one subdirectory per stage."),
        preset: str = typer.Option("demo", "--preset", help="demo (embedded model, CPU, ~12 min), quick (every stage with minimal work, ~5 min: a smoke check) or qwen3.5-4b (the paper's hyperparameters, GPU box)."),
        model: Optional[str] = typer.Option(None, "--model", help="BF16 model (directory, hub id or built-in name); default: the preset's."),
        ckpt: Optional[Path] = typer.Option(None, "--ckpt", help="An existing INT4 checkpoint of the model: skips `quantize`."),
        from_stage: Optional[str] = typer.Option(None, "--from", help="Re-run from this stage on (see the stage list printed by a run)."),
        device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
        quality: bool = typer.Option(True, "--quality/--no-quality", help="Run the quality evals whose task data is present."),
    ) -> None:
        """Run quantize -> qad -> data -> draft train 1 -> data (INT4) -> draft train 2 -> draft
        quantize -> draft swa -> eval, skipping stages already complete (by manifest)."""
        from qfd.stages.all import PipelineConfig, run

        run(PipelineConfig(out=out, preset=preset, model=model, ckpt=ckpt, from_stage=from_stage, device=device, quality=quality))
