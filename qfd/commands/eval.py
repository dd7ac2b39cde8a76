"""`qfd eval TASK...`: quality gates (mmlu-pro, ifeval, gpqa) and the latency protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from qfd.commands.generate import COMPILE_HELP, DRAFT_LEN_AUTO_HELP, DRAFT_VOCAB_HELP, INT4_HEAD_HELP, INT8_HEAD_HELP, SHORT_BLOCK_HELP, TREE_HELP

TASKS_HELP = (
    "Tasks: mmlu-pro (5-shot chat, custom-extract, unweighted mean of 14 subjects; gate 0.621), "
    "ifeval (0-shot, inst_level_strict_acc; gate 0.814), gpqa (GPQA-Diamond CoT zero-shot, "
    "flexible-extract, thinking on; gate 0.630), latency (short/medium/long protocol)."
)
DATA_HELP = (
    "Folder of local task JSONL (also searched one level down): ifeval.jsonl or input_data.jsonl "
    "(default: ../shared/data/ifeval/input_data.jsonl when present); mmlu_pro_test.jsonl + "
    "mmlu_pro_validation.jsonl; gpqa_diamond.jsonl. Missing files come from the Hugging Face Hub "
    "where it is reachable."
)


def register(app: typer.Typer, subapps: dict[str, typer.Typer]) -> None:
    @app.command("eval")
    def eval_command(
        tasks: list[str] = typer.Argument(..., help=TASKS_HELP, metavar="TASKS..."),
        target: str = typer.Option(..., "--target", "-t", help="Target model (INT4 or plain dir, built-in name, hub id)."),
        drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="DFlash drafter dir: generation is speculative."),
        baseline: Optional[str] = typer.Option(None, "--baseline", "-b", help="BF16 baseline model, target-only: side-by-side scores, the relative gate (>= 95%) and the latency speedups."),
        data_dir: Optional[Path] = typer.Option(None, "--data-dir", help=DATA_HELP),
        limit: Optional[int] = typer.Option(None, "--limit", help="At most N documents per task (per subject for MMLU-Pro)."),
        out: Path = typer.Option(Path("qfd-eval"), "--out", "-o", help="Results directory (written via <out>.partial/)."),
        batch_size: int = typer.Option(1, "--batch-size", help="Requests per generate call (the hf backend batches; the engine runs batch 1)."),
        device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N."),
        dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16."),
        max_gen_toks: Optional[int] = typer.Option(None, "--max-gen-toks", help="Cap every task's new-token budget (protocol: ifeval 1280, mmlu-pro 2048, gpqa 12288)."),
        backend: str = typer.Option("auto", "--backend", help="engine (qfd's served system), hf (transformers generate), auto (engine when installed)."),
        warmup: int = typer.Option(5, "--warmup", help="latency: untimed warm-up runs per setting."),
        runs: int = typer.Option(50, "--runs", help="latency: timed runs per setting (the median is reported)."),
        settings: str = typer.Option("short,medium,long", "--settings", help="latency: settings to run, comma separated."),
        lengths: Optional[str] = typer.Option(None, "--lengths", help="latency: NAME=IN/OUT,... to change or add settings (default short=64/128, medium=2048/256, long=8192/256)."),
        scale: float = typer.Option(1.0, "--scale", help="latency: multiply every length (e.g. 0.05 on a CPU)."),
        prompts: Optional[Path] = typer.Option(None, "--prompts", help="latency: JSONL of {\"question\": ...} prose (default ../shared/data/gsm8k/test.jsonl)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished results directory."),
        draft_len: Optional[str] = typer.Option(None, "--draft-len", help=DRAFT_LEN_AUTO_HELP, metavar="K|auto"),
        draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help=DRAFT_VOCAB_HELP),
        short_block: bool = typer.Option(False, "--short-block", help=SHORT_BLOCK_HELP),
        tree: int = typer.Option(0, "--tree", help=TREE_HELP, metavar="N"),
        compile_steps: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
        int4_head: bool = typer.Option(False, "--int4-head", help=INT4_HEAD_HELP + " (the target only, not --baseline)"),
        int8_head: bool = typer.Option(False, "--int8-head", help=INT8_HEAD_HELP + " (the target only, not --baseline)"),
    ) -> None:
        """Quality gates through lm-eval and the latency protocol, on qfd's engine (INT4 target,
        speculative with --drafter). Examples:

        qfd eval ifeval mmlu-pro gpqa --target q4 --drafter dflash --baseline bf16 --data-dir data

        qfd eval latency --target q4 --drafter dflash --baseline bf16
        """
        from qfd.draft_len_auto import parse_draft_len
        from qfd.stages.eval import EvalConfig, run, summary_tables
        from qfd.console import stdout

        cfg = EvalConfig(
            tasks=tuple(dict.fromkeys(t.lower() for t in tasks)), target=target, out=out, drafter=drafter, baseline=baseline,
            data_dir=data_dir, limit=limit, batch_size=batch_size, device=device, dtype=dtype, max_gen_toks=max_gen_toks,
            backend=backend, overwrite=overwrite, warmup=warmup, runs=runs,
            settings=tuple(s.strip() for s in settings.split(",") if s.strip()), lengths=lengths, scale=scale, prompts=prompts,
            draft_len=parse_draft_len(draft_len), draft_vocab=draft_vocab, short_block=short_block, tree=tree, compile_steps=compile_steps, int4_head=int4_head, int8_head=int8_head,
        )
        path = run(cfg)
        for table in summary_tables(path):
            stdout.print(table)
        stdout.print(f"results: [bold]{path}[/bold]")
