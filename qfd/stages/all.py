"""`qfd all`: the whole pipeline, one stage per subdirectory, resumable.

quantize (unless an INT4 checkpoint is given) -> qad -> data (BF16 target) -> draft train 1 ->
data (QAD INT4 target) -> draft train 2 -> draft quantize -> draft swa -> eval latency
(+ eval quality where task data is present) -> one summary table.

Each stage is the same subcommand a user would run by hand, invoked in-process with the
preset's flags, so `qfd all` and a shell script of single stages produce identical
directories. A stage counts as done only when its directory holds a manifest of the right
stage (written last, atomically); an interrupted stage resumes from its `<dir>.partial/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from qfd.errors import QfdError
from qfd.manifest import is_complete, read_manifest


@dataclass(frozen=True)
class PipelineConfig:
    out: Path
    preset: str = "demo"
    model: str | None = None  # BF16 model spec (default: the preset's)
    ckpt: Path | None = None  # an existing INT4 checkpoint: skip `quantize`
    from_stage: str | None = None  # re-run from this stage on
    device: str = "auto"
    quality: bool = True  # run the quality evals whose data is present


@dataclass(frozen=True)
class Step:
    """One pipeline stage: where it writes, what manifest stage marks it done, its argv."""

    name: str
    subdir: str
    manifest_stage: str
    argv: Callable[["Paths"], list[str]]
    enabled: Callable[["Paths"], bool] = lambda paths: True


@dataclass
class Paths:
    root: Path
    model: str
    ckpt: Path | None
    device: str
    extra: dict = field(default_factory=dict)

    def __getitem__(self, subdir: str) -> Path:
        return self.root / subdir

    @property
    def int4(self) -> Path:
        return self.ckpt if self.ckpt is not None else self["1-quantize"]


def run(cfg: PipelineConfig) -> Path:
    from qfd.presets import PRESETS, steps_for

    if cfg.preset not in PRESETS:
        raise QfdError(f"unknown preset '{cfg.preset}'; choose one of {', '.join(PRESETS)}")
    preset = PRESETS[cfg.preset]
    root = Path(cfg.out).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    paths = Paths(root=root, model=cfg.model or preset["model"], ckpt=cfg.ckpt, device=cfg.device)
    steps = [s for s in steps_for(preset, quality=cfg.quality) if s.enabled(paths)]
    names = [s.name for s in steps]
    if cfg.from_stage is not None and cfg.from_stage not in names:
        raise QfdError(f"--from {cfg.from_stage}: unknown stage; stages are {', '.join(names)}")
    rerun_from = names.index(cfg.from_stage) if cfg.from_stage else len(names)

    from qfd.console import console

    for index, step in enumerate(steps):
        out = paths[step.subdir]
        forced = index >= rerun_from
        if not forced and is_complete(out, stage=step.manifest_stage):
            console.print(f"[green]done[/green]   {step.name:16s} {out}")
            continue
        console.rule(f"[bold]{index + 1}/{len(steps)} {step.name}[/bold]")
        argv = step.argv(paths) + (["--overwrite"] if forced and out.exists() else [])
        console.print(f"[dim]qfd {' '.join(argv)}[/dim]", highlight=False, soft_wrap=True)
        _invoke(argv)
        if not is_complete(out, stage=step.manifest_stage):
            raise QfdError(f"stage {step.name} finished without a complete {step.manifest_stage} checkpoint in {out}")
    _summary(root, steps, paths)
    return root


def _invoke(argv: list[str]) -> None:
    """Run one qfd subcommand in this process (QfdError propagates to the caller)."""
    import click

    from qfd.cli import app

    try:
        app(args=argv, standalone_mode=False)
    except click.exceptions.Exit as exc:
        if exc.exit_code:
            raise QfdError(f"'qfd {argv[0]}' exited with code {exc.exit_code}") from None


def _summary(root: Path, steps: list[Step], paths: Paths) -> None:
    from rich.table import Table

    from qfd.console import stdout

    table = Table(title=f"qfd all: {root}")
    table.add_column("stage")
    table.add_column("directory")
    table.add_column("key results")
    for step in steps:
        manifest = read_manifest(paths[step.subdir]) or {}
        metrics = manifest.get("metrics", {})
        table.add_row(step.name, step.subdir, _headline(metrics))
    stdout.print(table)


def _headline(metrics: dict, limit: int = 6) -> str:
    """The scalar metrics of a stage, compactly."""
    parts = []
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
        if len(parts) == limit:
            break
    return ", ".join(parts)
