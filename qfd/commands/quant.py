"""`qfd quantize` (INT4 start point) and `qfd qad` (grid-preserving QAD)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, subapps: dict[str, typer.Typer]) -> None:
    @app.command()
    def quantize(
        model: str = typer.Option(..., "--model", help="BF16 model: directory, hub id or built-in name (smollm2-135m)."),
        out: Path = typer.Option(..., "--out", help="Output INT4 directory."),
        method: str = typer.Option("gptq", "--method", help="gptq | awq | rtn (awq runs gptqmodel: slow on CPU)."),
        group_size: Optional[int] = typer.Option(None, "--group-size", help="32 | 64 | 128 (default: 128 if it divides every linear, else 64, else 32)."),
        bits: int = typer.Option(4, "--bits", help="Bit width (4)."),
        format: str = typer.Option("compressed-tensors", "--format", help="compressed-tensors | awq | gptq."),
        sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="Symmetric grid or zero points (default: zero points for awq, else symmetric)."),
        calib_data: Optional[str] = typer.Option(None, "--calib-data", help="Calibration text (.jsonl/.txt); default GSM8K train."),
        samples: int = typer.Option(64, "--samples", help="Calibration texts."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished --out."),
    ) -> None:
        """Make an INT4 checkpoint (the QAD start point) from a BF16 model."""
        from qfd.console import stdout
        from qfd.stages.quantize import QuantizeConfig, run

        cfg = QuantizeConfig(model=model, out=out, method=method, group_size=group_size, bits=bits, format=format, symmetric=sym, calib_data=calib_data, samples=samples, overwrite=overwrite)
        path, metrics = run(cfg)
        _summary(stdout, f"INT4 checkpoint written: {path}", metrics)

    @app.command()
    def qad(
        ckpt: Path = typer.Option(..., "--ckpt", help="INT4 checkpoint (compressed-tensors / AWQ GEMM / GPTQ v1)."),
        out: Path = typer.Option(..., "--out", help="Output INT4 directory (same format, same scales/zeros)."),
        teacher: Optional[str] = typer.Option(None, "--teacher", help="BF16 teacher (default: the INT4 checkpoint's recorded parent)."),
        data: Optional[str] = typer.Option(None, "--data", help="Training text: .jsonl/.txt file or a datasets name."),
        generate_from: Optional[str] = typer.Option(None, "--generate-from", help="Prompts the teacher answers to make the training text (default when --data is not given: GSM8K train)."),
        generate_samples: int = typer.Option(256, "--generate-samples", help="Prompts to generate from."),
        generate_tokens: int = typer.Option(256, "--generate-tokens", help="Max new tokens per generated response."),
        steps: int = typer.Option(200, "--steps"),
        lr: float = typer.Option(1e-5, "--lr"),
        seq_len: int = typer.Option(256, "--seq-len"),
        batch_size: int = typer.Option(4, "--batch-size"),
        grad_accum: int = typer.Option(1, "--grad-accum"),
        eval_every: int = typer.Option(50, "--eval-every"),
        eval_blocks: int = typer.Option(8, "--eval-blocks", help="Held-out blocks of --seq-len tokens."),
        kl_chunk: int = typer.Option(1024, "--kl-chunk", help="Tokens per KL chunk (bounds logits memory)."),
        device: str = typer.Option("auto", "--device"),
        dtype: str = typer.Option("auto", "--dtype", help="Teacher/compute dtype (latents stay fp32)."),
        seed: int = typer.Option(0, "--seed"),
        overwrite: bool = typer.Option(False, "--overwrite"),
    ) -> None:
        """QAD: distil the BF16 teacher into the INT4 checkpoint on its own frozen grid."""
        from qfd.console import stdout
        from qfd.stages.qad import QadConfig, run

        cfg = QadConfig(ckpt=ckpt, out=out, teacher=teacher, data=data, generate_from=generate_from, generate_samples=generate_samples, generate_tokens=generate_tokens, steps=steps, lr=lr, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, eval_every=eval_every, eval_blocks=eval_blocks, kl_chunk=kl_chunk, device=device, dtype=dtype, seed=seed, overwrite=overwrite)
        path, metrics = run(cfg)
        _summary(stdout, f"QAD checkpoint written: {path}", metrics)


def _summary(console, title: str, metrics: dict) -> None:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        if isinstance(value, (dict, list)):
            continue
        table.add_row(key, f"{value:.5g}" if isinstance(value, float) else str(value))
    console.print(table)
