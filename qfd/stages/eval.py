"""`qfd eval TASK...`: quality gates (MMLU-Pro, IFEval, GPQA-Diamond) and the latency protocol.

Recipe: validate everything (models, task data, latency settings) -> for each system (the
target, speculative when a drafter is given; the baseline, target-only) load it, run its
quality tasks and latency settings, free it -> results.json (+ latency.json, two PNGs,
per-task samples) -> manifest (stage `eval`, parents target / drafter / baseline).
Finished (system, task) results are kept in the staging state dir, so an interrupted run
resumes where it stopped. Protocol: method.md section 5.
"""

from __future__ import annotations

import gc
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qfd.console import console
from qfd.errors import QfdError

QUALITY_TASKS = ("mmlu-pro", "ifeval", "gpqa")
ALL_TASKS = (*QUALITY_TASKS, "latency")
RELATIVE_GATE = 0.95  # quality gate relative to the BF16 baseline (the paper's, section 5)
GSM8K_TEST = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...]
    target: str
    out: Path
    drafter: str | None = None
    baseline: str | None = None
    data_dir: Path | None = None
    limit: int | None = None
    batch_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    max_gen_toks: int | None = None  # cap on every task's budget (CPU runs)
    backend: str = "auto"  # engine | hf | auto (engine when qfd.engine is installed)
    overwrite: bool = False
    # latency protocol
    warmup: int = 5
    runs: int = 50
    settings: tuple[str, ...] = ("short", "medium", "long")
    lengths: str | None = None
    scale: float = 1.0
    prompts: Path | None = None
    draft_len: int | str | None = None  # drafts verified per step by the system's engine (None: B-1; "auto": measured, qfd.draft_len_auto)
    draft_vocab: int | None = None  # the drafter's LM head over its N most frequent ids (None: all; qfd.draft_vocab)
    short_block: bool = False  # the drafter runs only the draft_len + 1 verified block slots (Engine(short_block))
    tree: int = 0  # > 0: verify a draft tree of that many tokens per step (Engine(tree_size), qfd.tree)
    compile_steps: bool = False  # torch.compile the engine's fixed-shape steps (every system)
    int4_head: bool = False  # RTN INT4 LM head at load for the target (not for a --baseline model; qfd.quant.head)
    int8_head: bool = False  # the same in INT8 (qfd.quant.head.Int8Head)


@dataclass
class System:
    """One model under test: `role` is `system` (target [+ drafter]) or `baseline`."""

    role: str
    spec: str
    drafter: str | None
    label: str
    quality: bool = True  # the implicit target-only latency baseline skips the quality tasks
    int4_head: bool = False  # load_target(int4_head=True): the target's LM head in INT4
    int8_head: bool = False  # load_target(int8_head=True): the target's LM head in INT8


def validate(cfg: EvalConfig) -> dict[str, Any]:
    """Every user mistake, found before any model is loaded."""
    from qfd.checkpoint import resolve_model

    if not cfg.tasks:
        raise QfdError(f"name at least one task: {', '.join(ALL_TASKS)}")
    unknown = [t for t in cfg.tasks if t not in ALL_TASKS]
    if unknown:
        raise QfdError(f"unknown eval task(s) {', '.join(unknown)}; choose from {', '.join(ALL_TASKS)}")
    if cfg.backend not in ("auto", "engine", "hf"):
        raise QfdError(f"unknown --backend {cfg.backend}; use auto, engine or hf")
    if cfg.limit is not None and cfg.limit < 1:
        raise QfdError("--limit must be >= 1")
    if cfg.max_gen_toks is not None and cfg.max_gen_toks < 1:
        raise QfdError("--max-gen-toks must be >= 1")
    if cfg.int4_head and cfg.int8_head:
        raise QfdError("pass one of --int4-head or --int8-head, not both")
    plan: dict[str, Any] = {"target": resolve_model(cfg.target).path}
    if cfg.baseline:
        plan["baseline"] = resolve_model(cfg.baseline).path
    from qfd.engine import check_speculation_flags

    check_speculation_flags(cfg.drafter, cfg.draft_len, cfg.short_block, cfg.tree, cfg.draft_vocab)
    if cfg.drafter:
        drafter = Path(cfg.drafter).expanduser()
        if not (drafter / "config.json").is_file():
            raise QfdError(f"drafter {drafter} is not a drafter directory (no config.json); pass the output of `qfd draft train`")
        plan["drafter"] = drafter.resolve()
        from qfd.draft_len_auto import check_draft_len_or_auto
        from qfd.draft_vocab import check_draft_vocab
        from qfd.models.drafter import read_drafter_config

        check_draft_len_or_auto(cfg.draft_len, drafter, read_drafter_config(drafter).block_size)
        check_draft_vocab(drafter, cfg.draft_vocab)
    if cfg.compile_steps and cfg.backend == "hf":
        raise QfdError("--compile applies to qfd's engine; drop --backend hf")
    if (cfg.int4_head or cfg.int8_head) and cfg.backend == "hf":
        raise QfdError(f"--int{4 if cfg.int4_head else 8}-head applies to qfd's engine (load_target); drop --backend hf")
    backend = resolve_backend(cfg.backend, needs_engine=cfg.drafter is not None or cfg.compile_steps or cfg.int4_head or cfg.int8_head)
    plan["backend"] = backend
    quality = [t for t in cfg.tasks if t in QUALITY_TASKS]
    if quality:
        from qfd.tasks.data import find_task_data

        allow_hub = not _offline()
        plan["data"] = {t: find_task_data(t, cfg.data_dir, allow_hub) for t in quality}
    if "latency" in cfg.tasks:
        from qfd.latency import build_settings, parse_lengths, read_questions

        if cfg.warmup < 0 or cfg.runs < 1:
            raise QfdError("--warmup must be >= 0 and --runs >= 1")
        plan["settings"] = build_settings(cfg.settings, parse_lengths(cfg.lengths), cfg.scale)
        plan["questions"] = read_questions(cfg.prompts or GSM8K_TEST)
    return plan


def _offline() -> bool:
    import os

    return any(os.environ.get(k) == "1" for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def engine_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("qfd.engine", "qfd.models.loading"))


def resolve_backend(name: str, needs_engine: bool) -> str:
    if name == "hf" and needs_engine:
        raise QfdError("--drafter needs the qfd engine (speculative decoding); drop --backend hf")
    if name in ("engine", "auto") and not engine_available():
        if name == "engine" or needs_engine:
            raise QfdError("qfd's engine (qfd.engine / qfd.models.loading) is not installed in this build; use --backend hf without --drafter")
        return "hf"
    return "engine" if name == "auto" else name


def systems(cfg: EvalConfig, plan: dict[str, Any]) -> list[System]:
    """The system under test and, when there is something to compare against, a baseline:
    --baseline (BF16 target-only), else the target itself without its drafter. --int4-head
    applies to the target (and so to its target-only baseline), never to a --baseline model; so does --int8-head."""
    head = " (INT4 head)" if cfg.int4_head else " (INT8 head)" if cfg.int8_head else ""
    heads = {"int4_head": cfg.int4_head, "int8_head": cfg.int8_head}
    out = [System("system", str(plan["target"]), str(plan.get("drafter")) if cfg.drafter else None, ("target + drafter" if cfg.drafter else "target") + head, **heads)]
    if cfg.baseline:
        out.append(System("baseline", str(plan["baseline"]), None, "baseline (target-only)"))
    elif cfg.drafter and "latency" in cfg.tasks:
        out.append(System("baseline", str(plan["target"]), None, "target-only" + head, quality=False, **heads))
    return out


def run(cfg: EvalConfig) -> Path:
    from qfd.checkpoint import Staging
    from qfd.device import pick_device, pick_dtype

    plan = validate(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    staging = Staging(cfg.out, overwrite=cfg.overwrite)
    state = _state_for(staging, cfg)
    quality_tasks = [t for t in cfg.tasks if t in QUALITY_TASKS]
    include_dir = None
    if quality_tasks:
        from qfd.tasks.data import DEFAULT_MAX_GEN_TOKS, render_tasks

        budgets = {t: min(DEFAULT_MAX_GEN_TOKS[t], cfg.max_gen_toks or DEFAULT_MAX_GEN_TOKS[t]) for t in quality_tasks}
        include_dir = render_tasks(staging.path / "tasks", plan["data"], budgets)
        from qfd.nltk_data import ensure_punkt_tab

        ensure_punkt_tab()
    results: dict[str, Any] = {"quality": {}, "labels": {}, "backend": plan["backend"]}
    latency_report = None
    for system in systems(cfg, plan):
        results["labels"][system.role] = system.label
        own_tasks = quality_tasks if system.quality else []
        need_quality = [t for t in own_tasks if not (state / f"{system.role}-{t}.json").is_file()]
        need_latency = "latency" in cfg.tasks and not (state / f"{system.role}-latency.json").is_file()
        if need_quality or need_latency:
            loaded = load_system(system, plan["backend"], device, dtype, max_len=_max_len(cfg, plan), draft_len=cfg.draft_len, compile_steps=cfg.compile_steps, draft_vocab=cfg.draft_vocab, short_block=cfg.short_block, tree=cfg.tree)
            if loaded.engine is not None and loaded.engine.drafter is not None:  # the k it ran (e.g. chosen by "auto")
                (state / f"{system.role}-draft-len.json").write_text(json.dumps(loaded.engine.draft_len))
            for task in need_quality:
                _run_quality(loaded, task, cfg, include_dir, staging.path, state / f"{system.role}-{task}.json", system)
            if need_latency:
                _run_latency(loaded, system, cfg, plan, state / f"{system.role}-latency.json")
            del loaded
            gc.collect()
        for task in own_tasks:
            results["quality"].setdefault(task, {})[system.role] = json.loads((state / f"{system.role}-{task}.json").read_text())
        if (state / f"{system.role}-draft-len.json").is_file():
            results.setdefault("draft_len", {})[system.role] = json.loads((state / f"{system.role}-draft-len.json").read_text())
    for task, by_role in results["quality"].items():
        _add_gates(task, by_role)
    if "latency" in cfg.tasks:
        latency_report = _assemble_latency(cfg, plan, state, results["labels"])
        results["latency"] = latency_report
    (staging.path / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    parents = {"target": plan["target"]}
    if cfg.drafter:
        parents["drafter"] = plan["drafter"]
    if cfg.baseline:
        parents["baseline"] = plan["baseline"]
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["backend"] = plan["backend"]
    return staging.commit(stage="eval", parents=parents, config=config, metrics=headline_metrics(results))


def _state_for(staging: Any, cfg: EvalConfig) -> Path:
    """The resumable state dir; results of an interrupted run are reused only when that run
    had the same settings (the batch size aside: it does not change what is measured)."""
    import shutil

    state = staging.state_dir()
    wanted = {k: str(v) for k, v in asdict(cfg).items() if k not in ("overwrite", "batch_size")}
    marker = state / "config.json"
    if marker.is_file() and json.loads(marker.read_text()) != wanted:
        console.print("[yellow]the interrupted eval in the staging directory had other settings: starting over[/yellow]")
        shutil.rmtree(state)
        state = staging.state_dir()
    marker.write_text(json.dumps(wanted, indent=2) + "\n")
    return state


def _max_len(cfg: EvalConfig, plan: dict[str, Any]) -> int:
    """KV budget for the engine: the longest prompt + budget any task of this run can need."""
    from qfd.tasks.data import DEFAULT_MAX_GEN_TOKS

    need = 0
    for task in (t for t in cfg.tasks if t in QUALITY_TASKS):
        need = max(need, 4096 + min(DEFAULT_MAX_GEN_TOKS[task], cfg.max_gen_toks or DEFAULT_MAX_GEN_TOKS[task]))
    for setting in plan.get("settings", []):
        need = max(need, setting.input_len + setting.output_len + 64)
    return need


class LoadedSystem:
    """A model ready for both jobs: a text generator (quality) and a timed generate (latency)."""

    def __init__(self, tokenizer: Any, generator: Any, timed: Any, engine: Any = None):
        self.tokenizer, self.generator, self.timed, self.engine = tokenizer, generator, timed, engine


def load_system(system: System, backend: str, device: Any, dtype: Any, max_len: int, draft_len: int | str | None = None, compile_steps: bool = False, draft_vocab: int | None = None, short_block: bool = False, tree: int = 0) -> LoadedSystem:
    from qfd.harness import EngineGenerator, HFGenerator
    from qfd.latency import engine_timed_generate, hf_timed_generate

    console.print(f"[dim]loading {system.label}: {system.spec}{' + ' + system.drafter if system.drafter else ''} ({backend}, {device}, {dtype})[/dim]")
    if backend == "hf":
        from qfd.models.hf import load_hf_causal_lm, load_tokenizer

        model = load_hf_causal_lm(system.spec, device, dtype)
        tokenizer = load_tokenizer(system.spec)
        return LoadedSystem(tokenizer, HFGenerator(model, tokenizer), hf_timed_generate(model))
    from qfd.engine import Engine
    from qfd.models.loading import load_target

    target, tokenizer = load_target(system.spec, device, dtype, int4_head=system.int4_head, int8_head=system.int8_head)
    drafter = None
    if system.drafter:
        from qfd.models.drafter import load_drafter

        drafter = load_drafter(system.drafter, device, dtype, fuse=True)
    if drafter is not None:  # "auto": timed here, with this system's engine settings
        from qfd.draft_len_auto import SAMPLE_TEXT, resolve_draft_len

        draft_len = resolve_draft_len(draft_len, target, tokenizer, drafter, Path(system.drafter), tokenizer.encode(SAMPLE_TEXT), draft_vocab=draft_vocab, short_block=short_block)
    # The engine preallocates its caches for max_len: no more than this run needs or the model has.
    # draft_len and draft_vocab concern the system with the drafter; baselines run target-only
    engine = Engine(target, tokenizer, drafter=drafter, max_len=min(max_len, int(target.config.max_position_embeddings)), draft_len=draft_len if drafter is not None else None, compile_steps=compile_steps,
                    draft_vocab=draft_vocab if drafter is not None else None, short_block=short_block and drafter is not None, tree_size=tree if drafter is not None else 0)
    return LoadedSystem(tokenizer, EngineGenerator(engine, tokenizer), engine_timed_generate(engine, device), engine)


def _run_quality(loaded: LoadedSystem, task: str, cfg: EvalConfig, include_dir: Path, out_dir: Path, done: Path, system: System) -> None:
    from qfd.console import progress_bar
    from qfd.harness import EngineGenerator, QfdLM

    with progress_bar() as progress:
        bar = progress.add_task(f"{task} ({system.label})", total=None)
        lm = QfdLM(loaded.generator, batch_size=cfg.batch_size, progress=lambda n: progress.update(bar, advance=n))
        outcome = evaluate_quiet(lm, task, include_dir, cfg.limit)
    with open(out_dir / f"samples-{system.role}-{task}.jsonl", "w") as handle:
        for name, rows in outcome["samples"].items():
            for row in rows:
                handle.write(json.dumps({"task": name, **row}, default=str) + "\n")
    record = {k: outcome[k] for k in ("score", "metric", "subtasks", "n")}
    record["results"] = outcome["results"]
    if isinstance(loaded.generator, EngineGenerator):
        record["engine"] = loaded.generator.summary()
    done.write_text(json.dumps(record, indent=2, default=str) + "\n")


def evaluate_quiet(lm: Any, task: str, include_dir: Path, limit: int | None) -> dict[str, Any]:
    """lm-eval's evaluation with its INFO chatter turned down (warnings still show)."""
    import logging

    from qfd.harness import evaluate_task

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        return evaluate_task(lm, task, include_dir, limit)
    finally:
        logger.setLevel(level)


def _add_gates(task: str, by_role: dict[str, Any]) -> None:
    from qfd.harness import GATE_METRIC

    gate = GATE_METRIC[task][2]
    by_role["paper_gate"] = gate
    by_role["passes_paper_gate"] = by_role["system"]["score"] >= gate
    if "baseline" in by_role:
        base = by_role["baseline"]["score"]
        by_role["relative"] = by_role["system"]["score"] / base if base > 0 else None
        by_role["passes_relative_gate"] = by_role["system"]["score"] >= RELATIVE_GATE * base


def _run_latency(loaded: LoadedSystem, system: System, cfg: EvalConfig, plan: dict[str, Any], done: Path) -> None:
    from qfd.console import progress_bar
    from qfd.latency import build_prompts, measure

    per_setting = {}
    with progress_bar() as progress:
        for setting in plan["settings"]:
            prompts = build_prompts(plan["questions"], loaded.tokenizer, setting.input_len, cfg.warmup + cfg.runs)
            bar = progress.add_task(f"latency {setting.name} {setting.input_len}/{setting.output_len} ({system.label})", total=cfg.warmup + cfg.runs)
            per_setting[setting.name] = measure(loaded.timed, prompts, setting.output_len, cfg.warmup, cfg.runs, advance=lambda n: progress.update(bar, advance=n))
    done.write_text(json.dumps(per_setting, indent=2) + "\n")


def _assemble_latency(cfg: EvalConfig, plan: dict[str, Any], state: Path, labels: dict[str, str]) -> dict[str, Any]:
    from qfd.latency import add_speedups, plot_acceptance, plot_latency

    report: dict[str, Any] = {"warmup": cfg.warmup, "runs": cfg.runs, "scale": cfg.scale, "labels": labels, "settings": {}}
    for setting in plan["settings"]:
        report["settings"][setting.name] = {"input_len": setting.input_len, "output_len": setting.output_len}
    for role in labels:
        measured = json.loads((state / f"{role}-latency.json").read_text())
        for name, summary in measured.items():
            report["settings"][name][role] = summary
    add_speedups(report)
    out_dir = state.parent
    (out_dir / "latency.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_latency(report, out_dir / "latency.png")
    plot_acceptance(report, out_dir / "acceptance.png")
    return report


def headline_metrics(results: dict[str, Any]) -> dict[str, Any]:
    """The few numbers a manifest (and `qfd all`'s summary) shows."""
    metrics: dict[str, Any] = {}
    for task, by_role in results.get("quality", {}).items():
        metrics[task] = by_role["system"]["score"]
        if "baseline" in by_role:
            metrics[f"{task}_baseline"] = by_role["baseline"]["score"]
    latency = results.get("latency")
    if latency:
        for name, entry in latency["settings"].items():
            if "speedup" in entry:
                metrics[f"speedup_{name}"] = entry["speedup"]
        for key in ("mean_speedup", "mean_tau"):
            if key in latency:
                metrics[key] = latency[key]
    return metrics


def summary_tables(path: Path) -> list[Any]:
    """Rich tables of a results directory: quality with both gates side by side; latency."""
    from rich.table import Table

    results = json.loads((Path(path) / "results.json").read_text())
    labels = results.get("labels", {})
    tables = []

    def mark(ok: bool | None) -> str:
        return "" if ok is None else ("[green]pass[/green]" if ok else "[red]fail[/red]")

    if results.get("quality"):
        has_base = any("baseline" in r for r in results["quality"].values())
        title = f"quality: {labels.get('system')}" + (f" vs {labels['baseline']}" if has_base else "") + f" ({results.get('backend')} backend)"
        table = Table(title=title, caption="mmlu-pro: exact_match custom-extract, mean of 14 subjects; ifeval: inst_level_strict_acc; gpqa: exact_match flexible-extract")
        for col in ("task", "n", "score", "paper gate", ""):
            table.add_column(col, justify="left" if col == "task" else "right")
        if has_base:
            for col in ("baseline", "relative", ">= 95%"):
                table.add_column(col, justify="right")
        for task, r in results["quality"].items():
            row = [task, str(r["system"]["n"]), f"{r['system']['score']:.4f}", f"{r['paper_gate']:.3f}", mark(r["passes_paper_gate"])]
            if has_base:
                if "baseline" in r:
                    rel = r.get("relative")
                    row += [f"{r['baseline']['score']:.4f}", "-" if rel is None else f"{rel:.3f}", mark(r.get("passes_relative_gate"))]
                else:
                    row += ["", "", ""]
            table.add_row(*row)
        tables.append(table)
    latency = results.get("latency")
    if latency:
        table = Table(title=f"latency: median of {latency['runs']} after {latency['warmup']} warm-ups" + (f" (lengths x{latency['scale']})" if latency["scale"] != 1 else ""))
        table.caption = ", ".join(f"{role}: {label}" for role, label in labels.items())
        for col in ("setting", "in/out", *(f"{r} s" for r in labels), "tok/s", "tau", "speedup"):
            table.add_column(col, justify="right" if col != "setting" else "left")
        for name, entry in latency["settings"].items():
            system = entry.get("system", {})
            row = [name, f"{entry['input_len']}/{entry['output_len']}"]
            row += [f"{entry[r]['median_s']:.4f}" for r in labels]
            row += [f"{system.get('tokens_per_s', 0):.1f}", f"{system['tau']:.2f}" if "tau" in system else "-",
                    f"{entry['speedup']:.2f}x" if "speedup" in entry else "-"]
            table.add_row(*row)
        if "mean_speedup" in latency:
            table.add_row("mean", "", *[""] * len(labels), "", f"{latency['mean_tau']:.2f}" if "mean_tau" in latency else "", f"[bold]{latency['mean_speedup']:.2f}x[/bold]")
        tables.append(table)
        rates = {n: e["system"]["accept_per_position"] for n, e in latency["settings"].items() if e.get("system", {}).get("accept_per_position")}
        if rates:
            # One row per draft position (a block of 16 drafts 15), one column per setting.
            width = max(len(r) for r in rates.values())
            table = Table(title="acceptance per draft position")
            table.add_column("position", justify="right")
            for name in rates:
                table.add_column(name, justify="right")
            for k in range(width):
                table.add_row(str(k + 1), *[f"{r[k]:.3f}" if k < len(r) else "" for r in rates.values()])
            tables.append(table)
    return tables
