"""`qfd serve`: an OpenAI-compatible HTTP server (speculative when given a drafter)."""

from __future__ import annotations

from pathlib import Path

import typer

from qfd.commands.generate import COMPILE_HELP, DRAFT_LEN_AUTO_HELP, DRAFT_VOCAB_HELP, INT4_HEAD_HELP, INT8_HEAD_HELP, SHORT_BLOCK_HELP, TREE_HELP


def register(app: typer.Typer, subapps: dict[str, typer.Typer]) -> None:
    @app.command()
    def serve(
        target: str = typer.Option(..., "--target", "-t", help="Target model: a directory, a hub id, or a built-in name (smollm2-135m)."),
        drafter: str = typer.Option(None, "--drafter", "-d", help="DFlash drafter directory (trained against this target) for speculative decoding."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default; others need care, see --api-key)."),
        port: int = typer.Option(8000, "--port", help="TCP port (0 = any free port)."),
        api_key: str = typer.Option(None, "--api-key", envvar="QFD_API_KEY", help="Require 'Authorization: Bearer KEY' on every request."),
        device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
        dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16."),
        max_len: int = typer.Option(None, "--max-len", help="Context length (prompt + completion); default: the model's max positions."),
        model_name: str = typer.Option(None, "--model-name", help="Model id clients send as 'model' (default: the target's name)."),
        allow_target_mismatch: bool = typer.Option(False, "--allow-target-mismatch", help="Serve a drafter pinned to another target fingerprint (loud warning)."),
        engine: str = typer.Option("qfd", "--engine", help="qfd (this package's engine) or vllm (export the pair as `qfd export vllm` does, then run `vllm serve` with DFlash; needs vLLM installed)."),
        export_dir: Path = typer.Option(None, "--export-dir", help="--engine vllm: where to write the export (default: ~/.cache/qfd/vllm-exports/)."),
        draft_len: str = typer.Option(None, "--draft-len", help=DRAFT_LEN_AUTO_HELP, metavar="K|auto"),
        draft_vocab: int = typer.Option(None, "--draft-vocab", help=DRAFT_VOCAB_HELP),
        short_block: bool = typer.Option(False, "--short-block", help=SHORT_BLOCK_HELP),
        tree: int = typer.Option(0, "--tree", help=TREE_HELP, metavar="N"),
        compile_steps: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
        int4_head: bool = typer.Option(False, "--int4-head", help=INT4_HEAD_HELP),
        int8_head: bool = typer.Option(False, "--int8-head", help=INT8_HEAD_HELP),
    ) -> None:
        """Serve /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health, /metrics."""
        from qfd.draft_len_auto import parse_draft_len
        from qfd.stages.serve import ServeConfig, run

        run(ServeConfig(target=target, drafter=drafter, host=host, port=port, api_key=api_key, device=device, dtype=dtype, allow_target_mismatch=allow_target_mismatch, max_len=max_len, model_name=model_name, engine=engine, export_dir=export_dir, draft_len=parse_draft_len(draft_len), draft_vocab=draft_vocab, short_block=short_block, tree=tree, compile_steps=compile_steps, int4_head=int4_head, int8_head=int8_head))
