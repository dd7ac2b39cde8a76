"""A step's attention over the KV cache at Qwen3.5-4B's attention shape (16 query heads, 4 kv
heads of 256), side by side: the served torch path (`qfd.models.target.grouped_attention`)
and the split-KV Triton kernels (`qfd.kernels.attention_triton`) over a grid of split-kernel
launch configs (keys per loop step, warps, stages), for a decode (1 token), a 16-token verify
and a 32-node tree, at a short and a long static cache. GPU only.

Timed as bench_int4_kernels.py times a kernel: calls captured in a CUDA graph, cycling through
copies of the cache so consecutive calls miss L2 (as in a step, where the layer's weights pass
between two attention layers). Prints a table, the fastest config per rows-per-program as a
QFD_ATTENTION_CONFIG line, and writes JSON.

    python bench/bench_attention.py [--keys 8704,512] [--out bench_attention.json]
    python bench/bench_attention.py --keys 8704 --filled 200,2100,8600   # the step's key count A/B
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_int4_kernels import copies_for, graph_time_us  # noqa: E402
from qfd import kernels  # noqa: E402
from qfd.kernels import attention_triton  # noqa: E402
from qfd.models.target import grouped_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 256
STEPS = (("decode", 1), ("verify 16", 16), ("tree 32", 32))
GRID = list(itertools.product((32, 64), (4, 8), (1, 2)))  # keys per step, warps, stages


def step_inputs(tokens: int, keys: int, copies: int):
    """q and `copies` K/V caches; the mask shows each query the keys up to its position (the
    cache full but for its last 64 slots)."""
    q = torch.randn(1, HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    caches = [(torch.randn(1, KV_HEADS, keys, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(1, KV_HEADS, keys, HEAD_DIM, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    positions = torch.arange(keys - 64 - tokens, keys - 64, device="cuda")
    mask = torch.arange(keys, device="cuda")[None, :] <= positions[:, None]
    return q, caches, mask


def key_count_ab(keys: int, fills: list[int], results: dict, out: Path) -> None:
    """The served config at a static cache of `keys` slots with `filled` of them written: the
    kernels given the step's key count (served) against the same call without it (every slot
    read, the tail masked), side by side; outputs checked equal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"step attention with a partly filled {keys}-slot cache, us per layer ({results['device']}, HBM-streamed K/V)")
    for col in ("step", "filled", "whole buffer", "filled keys only", "speedup", "max |diff|"):
        table.add_column(col, justify="right")
    for filled in fills:
        for name, tokens in STEPS:
            q, caches, _ = step_inputs(tokens, keys, copies_for(2 * KV_HEADS * keys * HEAD_DIM * 2, hot=False))
            positions = torch.arange(filled - tokens, filled, device="cuda")
            mask = torch.arange(keys, device="cuda")[None, :] <= positions[:, None]
            count = positions[-1:] + 1
            diff = (attention_triton.split_attention(q, *caches[0], mask).float() - attention_triton.split_attention(q, *caches[0], mask, count).float()).abs().max().item()
            whole = graph_time_us([lambda k=k, v=v: attention_triton.split_attention(q, k, v, mask) for k, v in caches])
            live = graph_time_us([lambda k=k, v=v: attention_triton.split_attention(q, k, v, mask, count) for k, v in caches])
            results["rows"].append({"step": name, "keys": keys, "filled": filled, "whole_buffer_us": whole, "key_count_us": live, "max_abs_diff": diff})
            table.add_row(name, str(filled), f"{whole:.1f}", f"{live:.1f}", f"{whole / live:.2f}x", f"{diff:.2g}")
    Console().print(table)
    out.write_text(json.dumps(results, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", default="8704,512", help="static cache lengths (long setting: 8704)")
    p.add_argument("--filled", default="", help="comma-separated filled lengths (e.g. 200,2100): only time the served config at the largest --keys cache with those keys filled, reading the filled keys (the step's key count) against the whole buffer under the mask")
    p.add_argument("--out", type=Path, default=Path("bench_attention.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py: needs a CUDA GPU")
    from rich.console import Console
    from rich.table import Table

    results = {"device": torch.cuda.get_device_name(), "shape": [HEADS, KV_HEADS, HEAD_DIM], "rows": []}
    if args.filled:
        return key_count_ab(max(int(k) for k in args.keys.split(",")), [int(f) for f in args.filled.split(",")], results, args.out)
    table = Table(title=f"step attention, us per layer ({results['device']}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, HBM-streamed K/V)")
    for col in ("step", "keys", "torch", "kernel (best config)", "torch / kernel", "best (keys, warps, stages)"):
        table.add_column(col, justify="right")
    for keys in (int(k) for k in args.keys.split(",")):
        for name, tokens in STEPS:
            q, caches, mask = step_inputs(tokens, keys, copies_for(2 * KV_HEADS * keys * HEAD_DIM * 2, hot=False))
            torch_us = graph_time_us([lambda k=k, v=v: grouped_attention(q, k, v, mask) for k, v in caches])
            row = {"step": name, "keys": keys, "torch_us": torch_us, "kernel_us": {}}
            expected = grouped_attention(q, *caches[0], mask).float()
            block_rows = attention_triton.block_rows_for(HEADS // KV_HEADS * tokens)
            for config in GRID:
                attention_triton.CONFIGS[block_rows] = config
                kernels._FAILED.clear()
                try:
                    out = attention_triton.split_attention(q, *caches[0], mask).float()
                    if kernels._FAILED or not torch.allclose(out, expected, rtol=3e-2, atol=3e-2):
                        raise RuntimeError("fell back" if kernels._FAILED else f"max error {(out - expected).abs().max():.3g}")
                    us = graph_time_us([lambda k=k, v=v: attention_triton.split_attention(q, k, v, mask) for k, v in caches])
                except Exception as exc:  # a config that does not compile or is wrong: skipped, said
                    row["kernel_us"][str(config)] = f"failed: {str(exc)[:80]}"
                    continue
                row["kernel_us"][str(config)] = us
            timed = {c: u for c, u in row["kernel_us"].items() if isinstance(u, float)}
            attention_triton.CONFIGS.pop(block_rows, None)
            if not timed:
                table.add_row(name, str(keys), f"{torch_us:.1f}", "all failed", "", "")
                results["rows"].append(row)
                continue
            fastest = min(timed, key=timed.get)
            row["best"] = fastest
            # per rows-per-program, the config fastest summed over the cache lengths
            for config, us in timed.items():
                sums = results.setdefault("sums", {}).setdefault(str(block_rows), {})
                sums[config] = sums.get(config, 0.0) + us
            table.add_row(name, str(keys), f"{torch_us:.1f}", f"{timed[fastest]:.1f}", f"{torch_us / timed[fastest]:.2f}x", fastest)
            results["rows"].append(row)
            args.out.write_text(json.dumps(results, indent=2))
    Console().print(table)
    chosen = {int(rows): min(sums, key=sums.get) for rows, sums in results.get("sums", {}).items()}
    results["chosen"] = chosen
    args.out.write_text(json.dumps(results, indent=2))
    line = ";".join(f"{rows}={config.strip('()').replace(' ', '')}" for rows, config in sorted(chosen.items()))
    print(f'QFD_ATTENTION_CONFIG="{line}"')


if __name__ == "__main__":
    main()
