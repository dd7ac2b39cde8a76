"""`qfd draft quantize` (GPTQ INT4) and `qfd draft swa` (sliding-window attention)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, subapps: dict[str, typer.Typer]) -> None:
    draft = subapps["draft"]

    @draft.command("quantize")
    def quantize(
        drafter: Path = typer.Option(..., "--drafter", help="A trained DFlash drafter directory (BF16, or with a sliding window)."),
        target: str = typer.Option(..., "--target", help="The target the drafter drafts for: its context features drive calibration."),
        out: Path = typer.Option(..., "--out", help="Output directory of the INT4 drafter."),
        group_size: int = typer.Option(128, "--group-size", help="INT4 group size (32, 64 or 128)."),
        samples: int = typer.Option(256, "--samples", help="Calibration conversations."),
        anchors_per_sample: int = typer.Option(16, "--anchors-per-sample", help="Drafter blocks per conversation."),
        data: Optional[Path] = typer.Option(None, "--data", help="Target-generated conversations (`qfd draft data` output); default: generate from GSM8K prompts."),
        max_length: int = typer.Option(1024, "--max-length", help="Longest calibration conversation, in tokens."),
        fmt: str = typer.Option("compressed-tensors", "--format", help="INT4 format: compressed-tensors (pack-quantized) or gptq."),
        backend: str = typer.Option("gptqmodel", "--backend", help="GPTQ per-layer math: gptqmodel or reference."),
        damp: float = typer.Option(0.01, "--damp", help="GPTQ damping, fraction of mean(diag H)."),
        sequential: bool = typer.Option(True, "--sequential/--no-sequential", help="Calibrate each layer on the already-quantized earlier layers."),
        seed: int = typer.Option(0, "--seed"),
        device: str = typer.Option("auto", "--device"),
        dtype: str = typer.Option("auto", "--dtype"),
        allow_target_mismatch: bool = typer.Option(False, "--allow-target-mismatch", help="Calibrate on a target other than the one the drafter pins (warns)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished --out."),
    ) -> None:
        """GPTQ INT4 of the drafter, calibrated on real drafter block forwards.

        Every linear (the fusion fc included), weight-only symmetric INT4, Hessians from
        drafter blocks at anchors of target-generated conversations with the target's
        context features; the manifest records per-layer error against round-to-nearest."""
        from qfd.console import stdout
        from qfd.stages.draft_quantize import DraftQuantizeConfig, run, summary_table

        cfg = DraftQuantizeConfig(
            drafter=drafter, target=target, out=out, group_size=group_size, samples=samples,
            anchors_per_sample=anchors_per_sample, data=data, max_length=max_length, format=fmt,
            backend=backend, damp=damp, sequential=sequential, seed=seed, device=device, dtype=dtype,
            overwrite=overwrite, allow_target_mismatch=allow_target_mismatch,
        )
        path = run(cfg)
        stdout.print(summary_table(path))
        stdout.print(f"[green]INT4 drafter written to[/green] {path}")

    @draft.command("swa")
    def swa(
        drafter: Path = typer.Option(..., "--drafter", help="A DFlash drafter directory (BF16 or INT4)."),
        window: int = typer.Option(1024, "--window", help="Attend to at most the last W context tokens."),
        out: Path = typer.Option(..., "--out", help="Output directory."),
        train_steps: int = typer.Option(0, "--train-steps", help="Optional short fine-tune with the window (BF16 drafters only)."),
        target: Optional[str] = typer.Option(None, "--target", help="Target for the fine-tune."),
        data: Optional[Path] = typer.Option(None, "--data", help="Target-generated conversations for the fine-tune."),
        lr: float = typer.Option(3e-4, "--lr", help="Fine-tune learning rate."),
        seed: int = typer.Option(0, "--seed"),
        device: str = typer.Option("auto", "--device"),
        dtype: str = typer.Option("auto", "--dtype"),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished --out."),
    ) -> None:
        """Sliding-window attention over the target context for the drafter.

        Written as HF/vLLM `sliding_window` fields; inside the block attention stays
        bidirectional. Optional short fine-tune with the window (--train-steps)."""
        from qfd.console import stdout
        from qfd.stages.draft_swa import DraftSwaConfig, run

        cfg = DraftSwaConfig(
            drafter=drafter, window=window, out=out, train_steps=train_steps, target=target, data=data,
            lr=lr, seed=seed, device=device, dtype=dtype, overwrite=overwrite,
        )
        path = run(cfg)
        stdout.print(f"[green]drafter with sliding window {window} written to[/green] {path}")
