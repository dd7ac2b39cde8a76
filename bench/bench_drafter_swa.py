"""The DFlash drafter's step time (append_context + draft) vs context length, with and without
a sliding window over the target context (method.md section 3).

    python bench/bench_drafter_swa.py [--shape embedded|qwen3.5-4b] [--contexts 1024,8192]
        [--window 1024] [--append 6] [--layers 5] [--device auto] [--dtype auto]
        [--repeats 20] [--warmup 3] [--threads N] [--out bench_drafter_swa.json]

One speculative step of the drafter = append_context of the tokens committed by the last
verify (--append, ~tau) + one draft forward of the block [token, MASK x 15] at the end of the
context (target head included, same in every row). Weights are random: time does not depend on
their values. With W = 1024 the draft attends to 1024 context tokens whatever the context, so
its step time at 8K should stay close to the time at 1K; without a window it grows with the
context. The table shows medians over --repeats after --warmup; the JSON has every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Drafter shapes: the embedded SmolLM2-135M target's, and the paper's Qwen3.5-4B drafter.
SHAPES = {
    "embedded": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152, num_target_layers=30),
    "qwen3.5-4b": dict(hidden_size=2560, num_attention_heads=16, num_key_value_heads=4, head_dim=256, intermediate_size=9216, vocab_size=248320, num_target_layers=32),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="embedded")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--contexts", default="1024,8192", help="comma-separated context lengths")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--append", type=int, default=6, help="tokens appended per step (about tau)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=Path("bench_drafter_swa.json"))
    return p.parse_args(argv)


def build(shape: str, layers: int, window: int | None, device, dtype):
    import torch

    from qfd.models.drafter import DFlashConfig, DFlashDrafter, default_tap_layers

    s = SHAPES[shape]
    cfg = DFlashConfig(num_hidden_layers=layers, target_layer_ids=default_tap_layers(s["num_target_layers"]), mask_token_id=s["vocab_size"] - 1, sliding_window=window, max_position_embeddings=65536, **s)
    torch.manual_seed(0)
    return DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()


def measure(drafter, embed, head, context: int, append: int, repeats: int, warmup: int, sync) -> dict:
    """Median ms of append_context(append tokens) and draft at `context` committed tokens."""
    import torch

    k_h = drafter.fc.in_features
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    cache = drafter.new_cache(context + drafter.block_size)
    with torch.inference_mode():
        prefix = torch.randn(1, context - append, k_h, device=device, dtype=dtype)
        for start in range(0, context - append, 2048):  # prefill (not timed), in chunks
            drafter.append_context(cache, prefix[:, start : start + 2048], start)
        new = torch.randn(1, append, k_h, device=device, dtype=dtype)
        appends, drafts = [], []
        for i in range(warmup + repeats):
            cache.rollback(context - append)
            sync()
            t0 = time.perf_counter()
            drafter.append_context(cache, new, context - append)
            sync()
            t1 = time.perf_counter()
            drafter.draft(cache, 1, context, embed=embed, head=head)
            sync()
            t2 = time.perf_counter()
            if i >= warmup:
                appends.append(1e3 * (t1 - t0))
                drafts.append(1e3 * (t2 - t1))
    a, d = statistics.median(appends), statistics.median(drafts)
    return {"append_ms": a, "draft_ms": d, "step_ms": statistics.median([x + y for x, y in zip(appends, drafts)])}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from rich.console import Console
    from rich.table import Table

    from qfd.device import pick_device, pick_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    contexts = [int(c) for c in args.contexts.split(",")]
    s = SHAPES[args.shape]
    embed = torch.nn.Embedding(s["vocab_size"], s["hidden_size"]).to(device=device, dtype=dtype)
    head = torch.nn.Linear(s["hidden_size"], s["vocab_size"], bias=False).to(device=device, dtype=dtype)
    rows = []
    for window in (None, args.window):
        drafter = build(args.shape, args.layers, window, device, dtype)
        for context in contexts:
            row = {"context": context, "window": window, **measure(drafter, embed, head, context, args.append, args.repeats, args.warmup, sync)}
            rows.append(row)
        del drafter
    table = Table(title=f"drafter step time: {args.shape} shape, {args.layers} layers, {device.type} {str(dtype).removeprefix('torch.')}, append {args.append}")
    for col in ("context", "window", "append_context ms", "draft ms", "step ms", f"step / step@{contexts[0]}"):
        table.add_column(col, justify="right")
    for row in rows:
        base = next(r for r in rows if r["window"] == row["window"] and r["context"] == contexts[0])
        row["ratio_to_shortest"] = row["step_ms"] / base["step_ms"]
        table.add_row(str(row["context"]), str(row["window"] or "none"), f"{row['append_ms']:.3f}", f"{row['draft_ms']:.3f}", f"{row['step_ms']:.3f}", f"{row['ratio_to_shortest']:.2f}x")
    Console().print(table)
    result = {"shape": args.shape, "layers": args.layers, "device": str(device), "dtype": str(dtype), "append": args.append, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
