"""tokens/s of qfd's runtime target vs transformers' `generate`, same model, prompt, greedy.

    python bench/bench_generate.py [--target smollm2-135m] [--max-new-tokens 64] [--device auto]
        [--dtype auto] [--repeats 3] [--compile] [--out bench_generate.json]

Both sides generate exactly N new tokens (EOS ignored) from the same prompt; the table shows
the median over --repeats runs after one warm-up: total tokens/s (prefill included), decode
tokens/s (after the first token), time to first token, and whether the greedy tokens agree.
--compile: qfd's decode step runs torch.compile'd over a static cache (mode reduce-overhead,
i.e. CUDA graphs, on CUDA), and transformers uses its static cache + compiled forward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Explain in a few "
    "paragraphs how this invention changed the spread of knowledge in Europe."
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (static cache; CUDA graphs on CUDA)")
    p.add_argument("--unfused-row", action="store_true", help="also time qfd with its projections unfused (load_target(fuse=False)), side by side")
    p.add_argument("--out", type=Path, default=Path("bench_generate.json"))
    return p.parse_args(argv)


def timed(fn, sync):
    sync()
    start = time.perf_counter()
    value = fn()
    sync()
    return time.perf_counter() - start, value


def bench_transformers(model_dir, ids, n, device, dtype, compile_, sync, repeats):
    """transformers' generate, greedy, exactly n tokens; TTFT from a 1-token generate."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir.path, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None  # exactly n tokens, no EOS suppression needed
    hf.generation_config.pad_token_id = 0
    kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    if compile_:
        kwargs["cache_implementation"] = "static"
    x = torch.tensor([ids], device=device)
    run = lambda k: hf.generate(x, max_new_tokens=k, **kwargs)  # noqa: E731
    with torch.inference_mode():
        run(n)  # warm-up (and compilation)
        totals, ttfts, out = [], [], None
        for _ in range(repeats):
            ttfts.append(timed(lambda: run(1), sync)[0])
            t, out = timed(lambda: run(n), sync)
            totals.append(t)
    return _row("transformers generate" + (" (static+compile)" if compile_ else ""), n, totals, ttfts), out[0, len(ids):].tolist()


def bench_qfd(model_dir, ids, n, device, dtype, compile_, sync, repeats, fuse=True):
    from qfd.models.loading import load_target
    from qfd.stages.generate import decode

    model, _ = load_target(model_dir, device, dtype, tokenizer=False, fuse=fuse)
    cache = model.new_cache(len(ids) + n, static=compile_)
    step = compiled_step(model, cache) if compile_ else None
    decode(model, ids, max_new_tokens=n, cache=cache, step=step)  # warm-up (and compilation)
    totals, ttfts, result = [], [], None
    for _ in range(repeats):
        result = decode(model, ids, max_new_tokens=n, cache=cache, step=step)
        totals.append(result.total_s)
        ttfts.append(result.ttft_s)
    return _row("qfd runtime" + (" (static+compile)" if compile_ else "") + ("" if fuse else " unfused projections"), n, totals, ttfts), result.tokens


def compiled_step(model, cache):
    """A 1-token decode step compiled over the static cache (gpt-fast's recipe): the cache
    buffers are marked static so CUDA graphs may mutate them in place."""
    import torch

    for buffers in (cache.k.values(), cache.v.values()):
        for t in buffers:
            torch._dynamo.mark_static_address(t)
    for state in cache.gdn.values():
        for t in (state.conv, state.recurrent, state.start, state.history):
            torch._dynamo.mark_static_address(t)
    device = model.model.embed_tokens.weight.device
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(model.forward_at, mode=mode, dynamic=False)


def _row(name, n, totals, ttfts):
    total, ttft = statistics.median(totals), statistics.median(ttfts)
    return {"name": name, "new_tokens": n, "total_s": total, "tokens_per_s": n / total, "ttft_s": ttft, "decode_tokens_per_s": (n - 1) / max(total - ttft, 1e-9), "runs": totals}


def main(argv=None):
    args = parse_args(argv)
    import torch
    from rich.console import Console
    from rich.table import Table

    from qfd.checkpoint import resolve_model
    from qfd.device import pick_device, pick_dtype
    from qfd.models.hf import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    model_dir = resolve_model(args.target)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokenizer = load_tokenizer(model_dir)
    ids = list(tokenizer(args.prompt).input_ids)
    n = args.max_new_tokens
    console.print(f"[dim]{args.target} on {device} ({dtype}), prompt {len(ids)} tokens, {n} new tokens, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}[/dim]")
    hf_row, hf_tokens = bench_transformers(model_dir, ids, n, device, dtype, args.compile, sync, args.repeats)
    qfd_row, qfd_tokens = bench_qfd(model_dir, ids, n, device, dtype, args.compile, sync, args.repeats)
    unfused_row = bench_qfd(model_dir, ids, n, device, dtype, args.compile, sync, args.repeats, fuse=False)[0] if args.unfused_row else None
    agree = next((i for i, (a, b) in enumerate(zip(hf_tokens, qfd_tokens)) if a != b), min(len(hf_tokens), len(qfd_tokens)))
    table = Table(title=f"qfd generate vs transformers generate: {args.target}, {device}, {str(dtype).replace('torch.', '')}, greedy, {n} tokens")
    for column in ("engine", "tokens/s", "decode tokens/s", "TTFT ms", "total s"):
        table.add_column(column, justify="right" if column != "engine" else "left")
    for row in (hf_row, qfd_row, unfused_row):
        if row is None:
            continue
        table.add_row(row["name"], f"{row['tokens_per_s']:.1f}", f"{row['decode_tokens_per_s']:.1f}", f"{row['ttft_s'] * 1000:.0f}", f"{row['total_s']:.2f}")
    Console().print(table)
    speedup = qfd_row["tokens_per_s"] / hf_row["tokens_per_s"]
    console.print(f"qfd / transformers: {speedup:.2f}x tokens/s; greedy tokens identical for the first {agree} of {n}")
    if unfused_row:
        console.print(f"qfd fused / unfused projections: {qfd_row['decode_tokens_per_s'] / unfused_row['decode_tokens_per_s']:.2f}x decode tokens/s")
    report = {
        "target": args.target, "device": str(device), "dtype": str(dtype), "prompt_tokens": len(ids), "new_tokens": n,
        "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0], "compile": args.compile,
        "transformers": hf_row, "qfd": qfd_row, "qfd_unfused": unfused_row, "speedup": speedup, "identical_prefix_tokens": agree,
        "torch": torch.__version__,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"[dim]wrote {args.out}[/dim]")


if __name__ == "__main__":
    main()
