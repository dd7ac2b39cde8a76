"""`qfd serve`: load target (+ drafter), check they belong together, serve the OpenAI API.

validate (target resolves, drafter matches the target's fingerprint, host/port/key sane) ->
load -> engine -> bind -> serve until interrupted. Nothing is written to disk.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from qfd.errors import QfdError

GRAPH_MAX_LEN = 16384  # the longest context served with CUDA graphs (see run())


@dataclass(frozen=True)
class ServeConfig:
    target: str
    drafter: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    allow_target_mismatch: bool = False
    max_len: int | None = None  # context (prompt + completion); default: the model's positions
    model_name: str | None = None  # the id clients pass as `model`; default: the target's name
    engine: str = "qfd"  # qfd (this package's engine) or vllm (export, then `vllm serve`)
    export_dir: Path | None = None  # --engine vllm: where the export goes (default: the qfd cache)
    draft_len: int | str | None = None  # drafts verified per step (None: the drafter's B-1; "auto": measured, qfd.draft_len_auto)
    draft_vocab: int | None = None  # drafter LM head over the N most frequent ids (None: all; qfd.draft_vocab)
    short_block: bool = False  # the drafter runs only the draft_len + 1 verified block slots (Engine(short_block))
    tree: int = 0  # > 0: verify a draft tree of that many tokens per step (Engine(tree_size), qfd.tree)
    compile_steps: bool = False  # torch.compile the fixed-shape steps (implies them; CUDA graphs on CUDA)
    int4_head: bool = False  # RTN INT4 LM head at load (load_target(int4_head), qfd.quant.head)
    int8_head: bool = False  # RTN INT8 LM head at load (load_target(int8_head), qfd.quant.head.Int8Head)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_config(cfg: ServeConfig) -> None:
    if not 0 <= cfg.port <= 65535:
        raise QfdError(f"--port must be in 0..65535 (got {cfg.port})")
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise QfdError("--api-key is empty; give a non-empty key or drop the option")
    if cfg.max_len is not None and cfg.max_len < 2:
        raise QfdError(f"--max-len must be >= 2 (got {cfg.max_len})")
    from qfd.engine import check_speculation_flags

    check_speculation_flags(cfg.drafter, cfg.draft_len, cfg.short_block, cfg.tree, cfg.draft_vocab)


def build(cfg: ServeConfig):
    """Everything up to a bound server (tests and `run` share it)."""
    from qfd.checkpoint import resolve_model
    from qfd.console import console
    from qfd.device import pick_device, pick_dtype
    from qfd.engine import Engine
    from qfd.models.loading import load_target, stop_token_ids, target_config
    from qfd.server import make_server

    check_config(cfg)
    model_dir = resolve_model(cfg.target)
    target_config(model_dir)
    drafter_dir = None
    if cfg.drafter:
        drafter_dir = Path(cfg.drafter).expanduser()
        if not drafter_dir.is_dir():
            raise QfdError(f"drafter directory {drafter_dir} does not exist")
        from qfd.draft_len_auto import check_draft_len_or_auto
        from qfd.models.drafter import read_drafter_config, verify_drafter_target

        verify_drafter_target(drafter_dir, model_dir.path, allow_mismatch=cfg.allow_target_mismatch)
        check_draft_len_or_auto(cfg.draft_len, drafter_dir, read_drafter_config(drafter_dir).block_size)  # before the long load
        from qfd.draft_vocab import check_draft_vocab

        check_draft_vocab(drafter_dir, cfg.draft_vocab)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    target, tokenizer = load_target(model_dir, device, dtype, int4_head=cfg.int4_head, int8_head=cfg.int8_head)
    if tokenizer is None:
        raise QfdError(f"{model_dir.path} has no tokenizer files; the server needs one (copy tokenizer.json / tokenizer_config.json into it)")
    drafter = None
    if drafter_dir is not None:
        from qfd.models.drafter import load_drafter

        drafter = load_drafter(drafter_dir, device, dtype, fuse=True)
    max_len = cfg.max_len or target.config.max_position_embeddings
    if cfg.compile_steps:
        console.print("[dim]compiling the fixed-shape steps (torch.compile; the first start is slow)[/dim]", highlight=False)
    # CUDA graphs (the engine's default on a GPU) replay fixed shapes: every decode step attends
    # over the whole static cache, so a context of the model's full length (e.g. 262K) would make
    # each step pay for it. Past GRAPH_MAX_LEN the server runs eagerly unless --max-len caps it.
    graphs = None if max_len <= GRAPH_MAX_LEN else False
    if graphs is False and device.type == "cuda" and not cfg.compile_steps:
        console.print(f"[dim]context {max_len} > {GRAPH_MAX_LEN}: eager steps, no CUDA graphs (pass --max-len to cap the context and use them)[/dim]", highlight=False)
    draft_len = cfg.draft_len
    if drafter is not None:
        from qfd.draft_len_auto import SAMPLE_TEXT, resolve_draft_len

        draft_len = resolve_draft_len(draft_len, target, tokenizer, drafter, drafter_dir, tokenizer.encode(SAMPLE_TEXT), draft_vocab=cfg.draft_vocab, short_block=cfg.short_block, cuda_graphs=graphs)
    engine = Engine(target, tokenizer, drafter=drafter, max_len=max_len, eos_ids=stop_token_ids(model_dir, tokenizer), draft_len=draft_len, compile_steps=cfg.compile_steps, draft_vocab=cfg.draft_vocab, short_block=cfg.short_block, tree_size=cfg.tree, cuda_graphs=graphs)
    name = cfg.model_name or (cfg.target if not Path(cfg.target).expanduser().exists() else model_dir.path.name)
    if not is_loopback(cfg.host) and not cfg.api_key:
        console.print(f"[bold yellow]warning:[/bold yellow] serving on {cfg.host} without --api-key: anyone who can reach this port can use the model", highlight=False)
    try:
        server = make_server(engine, name, cfg.host, cfg.port, cfg.api_key)
    except OSError as exc:
        raise QfdError(f"cannot listen on {cfg.host}:{cfg.port} ({exc.strerror or exc}); choose another --port or --host") from None
    return server


def vllm_argv(export: Path, cfg: ServeConfig) -> list[str]:
    """The `vllm serve` command for a `qfd export vllm` directory, with serve's own flags."""
    import json

    argv = ["vllm", "serve", str(export / "target"), "--host", cfg.host, "--port", str(cfg.port)]
    spec_file = export / "speculative_config.json"
    if cfg.drafter and spec_file.is_file():
        spec = json.loads(spec_file.read_text()) | {"model": str(export / "drafter")}
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if cfg.max_len:
        argv += ["--max-model-len", str(cfg.max_len)]
    if cfg.api_key:
        argv += ["--api-key", cfg.api_key]
    if cfg.model_name:
        argv += ["--served-model-name", cfg.model_name]
    return argv


def run_vllm(cfg: ServeConfig) -> None:
    """--engine vllm: export target + drafter in the layout vLLM loads (qfd export vllm), then
    replace this process by `vllm serve` with the DFlash speculative config."""
    import os
    import shutil

    from qfd.checkpoint import resolve_model
    from qfd.console import console
    from qfd.manifest import fingerprint, is_complete

    check_config(cfg)
    if cfg.draft_len is not None:
        # vLLM takes its draft count from the export's speculative config (B-1); not mapped here
        raise QfdError("--draft-len applies to --engine qfd; vLLM drafts the export's num_speculative_tokens")
    if cfg.short_block:
        raise QfdError("--short-block applies to --engine qfd; vLLM's DFlash drafter runs the whole block")
    if cfg.tree:
        raise QfdError("--tree applies to --engine qfd; vLLM's DFlash verifies a chain")
    if cfg.draft_vocab is not None:
        raise QfdError("--draft-vocab applies to --engine qfd; vLLM's DFlash drafter uses the full LM head")
    if cfg.compile_steps:
        raise QfdError("--compile applies to --engine qfd; vLLM compiles on its own")
    if cfg.int4_head or cfg.int8_head:
        raise QfdError(f"--int{4 if cfg.int4_head else 8}-head applies to --engine qfd; vLLM loads the exported head as it is")
    if shutil.which("vllm") is None:
        raise QfdError("--engine vllm: vLLM is not installed here (no `vllm` on PATH); install it on a CUDA machine (pip install vllm), or use --engine qfd")
    target = resolve_model(cfg.target)
    if cfg.drafter:
        from qfd.stages.export_vllm import ExportConfig
        from qfd.stages.export_vllm import run as export

        key = f"{fingerprint(target.path)}-{fingerprint(Path(cfg.drafter).expanduser())}"
        out = Path(cfg.export_dir or Path.home() / ".cache" / "qfd" / "vllm-exports" / key).expanduser()
        if not is_complete(out, stage="export-vllm"):
            export(ExportConfig(target=str(target.path), drafter=Path(cfg.drafter), out=out, overwrite=True, allow_target_mismatch=cfg.allow_target_mismatch))
    else:
        out = None
    argv = vllm_argv(out, cfg) if out is not None else ["vllm", "serve", str(target.path), "--host", cfg.host, "--port", str(cfg.port)]
    console.print(f"[bold green]qfd serve --engine vllm[/bold green]: {' '.join(argv[:3])} ...", highlight=False)
    os.execvp(argv[0], argv)


def run(cfg: ServeConfig) -> Path:
    """Serve until Ctrl-C; returns the target directory served."""
    from qfd.console import console

    if cfg.engine == "vllm":
        run_vllm(cfg)
    if cfg.engine != "qfd":
        raise QfdError(f"--engine must be qfd or vllm (got {cfg.engine!r})")
    server = build(cfg)
    host, port = server.server_address[:2]
    engine = server.app.engine
    vocab = f", draft vocabulary {engine.draft_vocab}" if engine.draft_vocab else ""
    vocab += ", short block" if engine.short_block else ""
    vocab += f", tree of {engine.tree_size}" if engine.tree_size else ""
    mode = f"speculative (DFlash, block {engine.block_size}, {engine.draft_len} drafts per step{vocab})" if engine.drafter is not None else "target-only"
    mode += ", INT4 LM head" if cfg.int4_head else ", INT8 LM head" if cfg.int8_head else ""
    steps = ", CUDA graphs" if engine.cuda_graphs and engine.device.type == "cuda" else ""
    console.print(f"[bold green]qfd serve[/bold green] model [bold]{server.app.model_name}[/bold], {mode}, context {engine.max_len}{steps}, on http://{host}:{port}/v1", highlight=False)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        console.print("[dim]shutting down[/dim]")
    finally:
        server.app.worker.stop()
        server.server_close()
    return Path(cfg.target)
