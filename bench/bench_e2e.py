"""End to end at T=0 on held-out GSM8K test prompts: qfd target-only vs qfd speculative
(DFlash drafter), eager and with CUDA graphs, plus transformers' generate (dynamic cache, and
static cache + torch.compile on CUDA) as the outside anchor - side by side in one run.

    python bench/bench_e2e.py --target DIR --drafter DIR [--prompts test.jsonl] [--num 8]
        [--max-new-tokens 256] [--device cuda] [--hf-compile] [--no-hf] [--out e2e.json]
        [--few-shot K --shots train.jsonl] [--windows 256,1024] [--max-len 8192] [--draft-lens 4,8]
        [--compile] [--draft-vocab 8192] [--int4-head | --int8-head] [--trees 16,32,64]

--few-shot K makes long prompts: K solved GSM8K train problems as earlier chat turns before
each test question. --windows adds rows where the drafter sees only the last W context tokens
(sliding window, method.md section 3), to report tau before/after SWA on those prompts.
--draft-lens adds speculative rows that verify only k drafts per step (Engine(draft_len=k);
the default row is k = B-1): on a CPU, where a verify costs more than a decode step, fewer
drafts can pay off sooner. --compile adds a target-only and a DFlash row whose fixed-shape steps
are torch.compile'd before CUDA-graph capture (Engine(compile_steps=True); on a CPU the compiled
steps run without graphs); a compile failure is printed and the other rows kept.
--draft-vocab N[,N...] adds speculative rows whose drafter LM head covers only the N most
frequent ids of its training data (Engine(draft_vocab=N); the drafter directory needs a
draft_vocab.safetensors, see `qfd draft vocab`), each also at every --draft-lens k.
--short-block adds each --draft-lens row again with the drafter's block forward over only the
k + 1 slots it verifies instead of all B (Engine(short_block=True)): k+1/B of its work, drafts
from a block shape it was not trained on (tau shows what that costs; output stays lossless).
--int4-head loads the target with its LM head in INT4 (load_target(int4_head=True),
qfd.quant.head) for every qfd row; the transformers rows keep the checkpoint's head. --int8-head
does the same with the INT8 head (load_target(int8_head=True), qfd.quant.head.Int8Head).
--trees N[,N...] adds speculative rows that verify a draft tree of N tokens per step instead of
the chain (Engine(tree_size=N), qfd.tree),
each also with every --draft-lens k (the tree's depth limit), --draft-vocab and --short-block row.

Prints a table (tokens/s, speedup over qfd's BF16 target-only eager and graphed paths, tau)
and how many speculative outputs are identical to target-only greedy (bf16 kernels may flip
near-tied tokens between a 1-token and a 16-token forward; every emitted token is the target's
own choice in its verify pass by construction).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prompts_from(path: Path, num: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row.get("question") or row.get("prompt") for row in rows[:num]]


def few_shot_turns(path: Path, k: int) -> list[dict]:
    """K solved problems as chat turns (user question, assistant answer): a long shared prefix."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[:k]]
    turns = []
    for row in rows:
        turns += [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
    return turns




def run_engine(engine, prompt_ids, max_new) -> dict:
    from qfd.engine import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new)
    engine.generate(prompt_ids[0], GenerationConfig(max_new_tokens=16))  # warm-up (and graph capture effects)
    outputs, tokens, seconds, taus, ttfts = [], 0, 0.0, [], []
    for ids in prompt_ids:
        result = engine.generate(ids, config)
        outputs.append(result.tokens)
        tokens += len(result.tokens)
        seconds += result.stats.total_s
        ttfts.append(result.stats.ttft_s)
        if result.stats.steps:
            taus.append(result.stats.tau)
    return {"outputs": outputs, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tau": sum(taus) / len(taus) if taus else None, "ttft_ms": 1e3 * sum(ttfts) / len(ttfts)}


def run_hf(model_dir, prompt_ids, max_new, device, dtype, compile_: bool) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    kwargs = dict(max_new_tokens=max_new, do_sample=False)
    if compile_:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(2 if compile_ else 1):  # warm-up / compile
            model.generate(torch.tensor([prompt_ids[0]], device=device), **{**kwargs, "max_new_tokens": 16})
        tokens, seconds = 0, 0.0
        for ids in prompt_ids:
            sync()
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids], device=device), **kwargs)
            sync()
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - len(ids)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tau": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl")
    p.add_argument("--num", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hf-compile", action="store_true", help="also transformers' static cache + torch.compile")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument("--few-shot", type=int, default=0, help="K solved problems before each question (long prompts)")
    p.add_argument("--shots", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/gsm8k/train.jsonl")
    p.add_argument("--windows", default="", help="comma-separated drafter sliding windows to add as rows")
    p.add_argument("--draft-lens", default="", help="comma-separated draft lengths k (1..B-1) to add as speculative rows")
    p.add_argument("--max-len", type=int, default=1024, help="engine context (prompt + new tokens)")
    p.add_argument("--no-eager", action="store_true", help="on CUDA, only the CUDA-graph rows")
    p.add_argument("--compile", action="store_true", help="also rows with the fixed-shape steps torch.compile'd before CUDA-graph capture")
    p.add_argument("--draft-vocab", default="", help="comma-separated draft vocabulary sizes N to add as speculative rows (each also at every --draft-lens k)")
    p.add_argument("--short-block", action="store_true", help="also each --draft-lens row with the drafter's block cut to its k + 1 used slots (Engine(short_block=True))")
    p.add_argument("--trees", default="", help="comma-separated tree sizes N to add as speculative rows verifying a draft tree of N tokens (qfd.tree; also compiled with --compile)")
    p.add_argument("--ab-rows", action="store_true", help="also rows without the chunked prefill and the draft prefetch, side by side (CUDA graphs on a GPU, not compiled): target-only and the first --trees size with the eager prompt forward (chunked_prefill=False), that tree without the draft prefetch")
    p.add_argument("--int4-head", action="store_true", help="the target's LM head in INT4 (RTN g128) for the qfd rows (load_target(int4_head=True))")
    p.add_argument("--int8-head", action="store_true", help="the target's LM head in INT8 (RTN g128) for the qfd rows (load_target(int8_head=True))")
    p.add_argument("--out", type=Path, default=Path("bench_e2e.json"))
    args = p.parse_args()
    if args.int4_head and args.int8_head:
        p.error("pass one of --int4-head or --int8-head")

    from qfd.checkpoint import resolve_model
    from qfd.engine import Engine
    from qfd.models.drafter_io import load_drafter
    from qfd.models.loading import load_target

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_dir = resolve_model(args.target).path
    target, tokenizer = load_target(target_dir, device, dtype, int4_head=args.int4_head, int8_head=args.int8_head)
    drafter = load_drafter(Path(args.drafter), device=device, dtype=dtype, fuse=True)
    draft_lens = [int(k) for k in args.draft_lens.split(",") if k]
    draft_vocabs = [int(v) for v in args.draft_vocab.split(",") if v]
    if draft_vocabs and drafter.draft_vocab_counts is None:
        p.error(f"--draft-vocab: drafter {args.drafter} has no draft vocabulary (draft_vocab.safetensors); make one with `qfd draft vocab`")
    max_len = args.max_len
    shots = few_shot_turns(args.shots, args.few_shot) if args.few_shot else []
    probe = Engine(target, tokenizer, max_len=max_len)
    prompt_ids = [probe.encode(shots + [{"role": "user", "content": q}]) for q in prompts_from(args.prompts, args.num)]
    del probe
    prompt_tokens = sum(map(len, prompt_ids)) / len(prompt_ids)

    rows = {}
    graphs = device.type == "cuda"
    eager = not (graphs and args.no_eager)
    modes = ([("eager", False)] if eager else []) + ([("CUDA graphs", True)] if graphs else [])
    compiled = "CUDA graphs + compile" if graphs else "static + compile"

    def add(name, row):  # every row is saved as it comes: a run cut by a time limit keeps the rows it has
        rows[name] = row
        args.out.write_text(json.dumps({"partial": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in rows.items()}}, indent=2))

    def compiled_row(name, **engine_args):  # a compile failure must not lose the other rows
        try:
            start = time.perf_counter()
            engine = Engine(target, tokenizer, max_len=max_len, compile_steps=True, **engine_args)
            build_s = time.perf_counter() - start  # compile + warm-up + capture: the slow first start
            add(name, run_engine(engine, prompt_ids, args.max_new_tokens) | {"build_s": build_s})
        except Exception as exc:
            print(f"{name} failed: {type(exc).__name__}: {exc}")

    for label, graphed in modes:
        add(f"qfd target-only ({label})", run_engine(Engine(target, tokenizer, max_len=max_len, cuda_graphs=graphed), prompt_ids, args.max_new_tokens))
    if args.compile:
        compiled_row(f"qfd target-only ({compiled})")
    for label, graphed in modes:
        add(f"qfd + DFlash ({label})", run_engine(Engine(target, tokenizer, drafter=drafter, max_len=max_len, cuda_graphs=graphed), prompt_ids, args.max_new_tokens))
    if args.compile:
        compiled_row(f"qfd + DFlash ({compiled})", drafter=drafter)
    shorts = [False, True] if args.short_block else [False]
    trees = [int(t) for t in args.trees.split(",") if t]
    for n in trees:  # trees over the whole block (k = B-1)
        for label, graphed in modes:
            add(f"qfd + DFlash, tree {n} ({label})", run_engine(Engine(target, tokenizer, drafter=drafter, max_len=max_len, cuda_graphs=graphed, tree_size=n), prompt_ids, args.max_new_tokens))
        if args.compile:
            compiled_row(f"qfd + DFlash, tree {n} ({compiled})", drafter=drafter, tree_size=n)
    if args.ab_rows:  # without this session's serving changes, on the last mode (CUDA graphs on a GPU)
        label, graphed = modes[-1]
        add(f"qfd target-only, eager prefill ({label})", run_engine(Engine(target, tokenizer, max_len=max_len, cuda_graphs=graphed, chunked_prefill=False), prompt_ids, args.max_new_tokens))
        for n in trees[:1]:
            tree_args = dict(drafter=drafter, max_len=max_len, cuda_graphs=graphed, tree_size=n)
            add(f"qfd + DFlash, tree {n}, eager prefill ({label})", run_engine(Engine(target, tokenizer, chunked_prefill=False, **tree_args), prompt_ids, args.max_new_tokens))
            add(f"qfd + DFlash, tree {n}, no draft prefetch ({label})", run_engine(Engine(target, tokenizer, prefetch_draft=False, **tree_args), prompt_ids, args.max_new_tokens))
    for v in [None, *draft_vocabs]:
        for k in ([] if v is None else [None]) + draft_lens:
            for short in shorts if k is not None else [False]:
                for n in [0, *trees]:
                    for label, graphed in modes:
                        parts = [f"draft vocab {v}"] * (v is not None) + [f"draft length {k}"] * (k is not None) + ["short block"] * short + [f"tree {n}"] * (n > 0)
                        name = f"qfd + DFlash, {', '.join(parts)} ({label})"
                        engine = Engine(target, tokenizer, drafter=drafter, max_len=max_len, cuda_graphs=graphed, draft_len=k, draft_vocab=v, short_block=short, tree_size=n)
                        add(name, run_engine(engine, prompt_ids, args.max_new_tokens))
    full_window = drafter.cfg
    for window in [int(w) for w in args.windows.split(",") if w]:
        drafter.cfg = replace(full_window, sliding_window=window)
        label, graphed = modes[-1]
        add(f"qfd + DFlash, drafter window {window} ({label})", run_engine(Engine(target, tokenizer, drafter=drafter, max_len=max_len, cuda_graphs=graphed), prompt_ids, args.max_new_tokens))
    drafter.cfg = full_window
    if not args.no_hf:
        rows["transformers generate (dynamic)"] = run_hf(target_dir, prompt_ids, args.max_new_tokens, device, dtype, compile_=False)
    if args.hf_compile and not args.no_hf and device.type == "cuda":
        try:
            rows["transformers generate (static+compile)"] = run_hf(target_dir, prompt_ids, args.max_new_tokens, device, dtype, compile_=True)
        except Exception as exc:  # report, do not lose the other rows
            print(f"transformers static+compile failed: {type(exc).__name__}: {exc}")

    base_key = "qfd target-only (CUDA graphs)" if graphs else "qfd target-only (eager)"
    reference = rows[next(iter(rows))]["outputs"]
    for name, row in rows.items():
        row["speedup_vs_qfd_target_only"] = row["tokens_per_s"] / rows[base_key]["tokens_per_s"]
        if "outputs" in row:
            row["identical_to_target_only"] = sum(a == b for a, b in zip(row.pop("outputs"), reference))

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"end to end, {args.num} GSM8K test prompts ({args.few_shot}-shot, {prompt_tokens:.0f} prompt tokens on average), {args.max_new_tokens} new tokens, T=0{', INT4 LM head (qfd rows)' if args.int4_head else ''}{', INT8 LM head (qfd rows)' if args.int8_head else ''}, {torch.cuda.get_device_name() if graphs else 'cpu'}")
    for col in ("system", "tokens/s", f"x {base_key}", "tau", "TTFT ms", "identical outputs"):
        table.add_column(col, justify="right")
    for name, row in rows.items():
        table.add_row(name, f"{row['tokens_per_s']:.1f}", f"{row['speedup_vs_qfd_target_only']:.2f}", "" if row["tau"] is None else f"{row['tau']:.2f}", f"{row['ttft_ms']:.1f}" if "ttft_ms" in row else "", str(row.get("identical_to_target_only", "")))
    Console().print(table)
    args.out.write_text(json.dumps({"device": str(device), "num": args.num, "few_shot": args.few_shot, "prompt_tokens_mean": prompt_tokens, "max_new_tokens": args.max_new_tokens, "int4_head": args.int4_head, "int8_head": args.int8_head, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
