"""Latency benchmark (method.md section 5) on one engine, in one run:

    dense target-only (the baseline: BF16 on CUDA)   | qfd engine
    INT4 target-only                  (--int4 DIR)   | qfd engine
    INT4 + DFlash drafter  (--int4 DIR --drafter D)  | qfd engine (dense + drafter without --int4)
    transformers generate (outside anchor)           | HF model of the dense target

Raw completion, greedy, exact input/output lengths (short 64/128, medium 2048/256, long
8192/256; `--scale 0.1` shrinks them for CPU), `--warmup` warm-ups and the median of `--runs`
timed runs per setting, realistic prose prompts (GSM8K test questions concatenated, cut by
tokens). Prints a rich table of medians, speedups vs the dense engine row, tau, tokens/s and
writes everything (incl. per-position acceptance) as JSON. Rows whose checkpoints are missing
are skipped with a reason.

    python bench/bench_latency.py --target smollm2-135m --drafter D --scale 0.1 --runs 5 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="dense target (directory or built-in name)")
    p.add_argument("--int4", default=None, help="INT4 target directory (QAD output); row skipped when absent")
    p.add_argument("--drafter", default=None, help="DFlash drafter directory; row skipped when absent")
    p.add_argument("--settings", default="short,medium,long")
    p.add_argument("--lengths", default=None, help="extra/overridden settings NAME=IN/OUT,...")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length (e.g. 0.1 on CPU)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--prompts", default=str(SHARED), help="GSM8K-style JSONL with a 'question' field")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="dtype of every row (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate anchor")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="bench/results/latency.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from rich.table import Table

    from qfd import latency
    from qfd.console import console, progress_bar
    from qfd.device import pick_device, pick_dtype
    from qfd.engine import Engine
    from qfd.models.loading import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    settings = latency.build_settings(args.settings.split(","), latency.parse_lengths(args.lengths), args.scale)
    questions = latency.read_questions(Path(args.prompts))
    longest = max(s.input_len + s.output_len for s in settings)

    rows: list[tuple[str, str | None, str | None, str]] = [("dense target-only", args.target, None, "engine")]
    skipped = {}
    int4_ok = args.int4 and Path(args.int4).expanduser().is_dir()
    drafter_ok = args.drafter and Path(args.drafter).expanduser().is_dir()
    if int4_ok:
        rows.append(("int4 target-only", args.int4, None, "engine"))
    else:
        skipped["int4 target-only"] = f"no INT4 checkpoint ({args.int4 or 'pass --int4 DIR'})"
    if drafter_ok:
        rows.append((("int4" if int4_ok else "dense") + " + drafter", args.int4 if int4_ok else args.target, args.drafter, "engine"))
    else:
        skipped["int4 + drafter"] = f"no drafter ({args.drafter or 'pass --drafter DIR'})"
    if not args.no_hf:
        rows.append(("transformers generate", args.target, None, "hf"))

    report = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "scale": args.scale, "warmup": args.warmup, "runs": args.runs,
              "settings": {s.name: {"input_len": s.input_len, "output_len": s.output_len} for s in settings}, "rows": {}, "skipped": skipped}
    prompts_cache = {}
    for label, spec, drafter_dir, backend in rows:
        console.print(f"[bold]{label}[/bold]: {spec}{' + ' + drafter_dir if drafter_dir else ''} ({backend}, {device}, {dtype})", highlight=False)
        t0 = time.perf_counter()
        if backend == "engine":
            target, tokenizer = load_target(spec, device, dtype)
            drafter = None
            if drafter_dir:
                from qfd.models.drafter import load_drafter

                drafter = load_drafter(drafter_dir, device, dtype, fuse=True)
            engine = Engine(target, tokenizer, drafter=drafter, max_len=longest + 1)
            timed = latency.engine_timed_generate(engine, device)
        else:
            from qfd.models.hf import load_hf_causal_lm, load_tokenizer

            model = load_hf_causal_lm(spec, device, dtype)
            tokenizer = load_tokenizer(spec)
            timed = latency.hf_timed_generate(model)
        entry = {"spec": spec, "drafter": drafter_dir, "backend": backend, "load_s": time.perf_counter() - t0, "settings": {}}
        with progress_bar() as bar:
            for s in settings:
                key = (s.name, id(tokenizer.__class__), tokenizer.vocab_size)
                if key not in prompts_cache:
                    prompts_cache[key] = latency.build_prompts(questions, tokenizer, s.input_len, args.warmup + args.runs)
                task = bar.add_task(f"{label} {s.name} {s.input_len}/{s.output_len}", total=args.warmup + args.runs)
                entry["settings"][s.name] = latency.measure(timed, prompts_cache[key], s.output_len, args.warmup, args.runs, advance=lambda n, t=task: bar.update(t, advance=n))
        report["rows"][label] = entry
        del timed
        if device.type == "cuda":
            torch.cuda.empty_cache()

    baseline = report["rows"]["dense target-only"]["settings"]
    for label, entry in report["rows"].items():
        speedups = []
        for name, summary in entry["settings"].items():
            summary["speedup"] = baseline[name]["median_s"] / summary["median_s"]
            speedups.append(summary["speedup"])
        entry["mean_speedup"] = sum(speedups) / len(speedups)

    table = Table(title=f"latency, median of {args.runs} ({device}, {report['dtype']}, scale {args.scale})")
    table.add_column("system")
    for s in settings:
        table.add_column(f"{s.name} {s.input_len}/{s.output_len}", justify="right")
    table.add_column("mean speedup", justify="right")
    for label, entry in report["rows"].items():
        cells = []
        for s in settings:
            m = entry["settings"][s.name]
            tau = f", tau {m['tau']:.2f}" if "tau" in m and entry["drafter"] else ""
            cells.append(f"{m['median_s'] * 1000:.0f} ms ({m['speedup']:.2f}x{tau}, {m['tokens_per_s']:.0f} tok/s)")
        table.add_row(label, *cells, f"{entry['mean_speedup']:.2f}x")
    for label, reason in skipped.items():
        table.add_row(f"[dim]{label}[/dim]", *([f"[dim]skipped[/dim]"] * len(settings)), f"[dim]{reason}[/dim]")
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print(f"[dim]wrote {out}[/dim]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
