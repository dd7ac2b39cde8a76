"""The LM head's product side by side at Qwen3.5-4B shape (248320 x 2560, tied head): bf16
(cuBLAS, what INT4 checkpoints ship), INT8 (`--int8-head`, qfd.kernels.int8_triton, over a small
launch-config sweep) and INT4 (`--int4-head`, Int4Linear's Triton kernel), at 1, 16 and 32 rows
(decode, chain verify, tree verify). Random weights: exact costs, no quality (for quality:
bench/bench_int4_head.py). CUDA only.

    python bench/bench_head.py [--rows 1,16,32] [--vocab 248320] [--hidden 2560] [--out head.json]

Each time is the median of 7 CUDA-event timings of 20 back-to-back calls (after a warm-up),
per call; GB/s counts the weight bytes read (codes + scales), ratios are against bf16 at the
same rows. The INT8 rows also check the kernel against its float32 reference on the same input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_ms(fn, reps: int = 7, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def sweep_configs(rows: int):
    from qfd.kernels.int8_triton import Int8Config

    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                if rows == 1:
                    yield Int8Config(use_dot=False, block_n=block_n, num_warps=warps, num_stages=stages)
                else:
                    yield Int8Config(use_dot=True, block_n=block_n, block_m=16 if rows <= 16 else 32, num_warps=warps, num_stages=stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,32")
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("bench_head.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_head.py: needs a CUDA GPU")

    from rich.console import Console
    from rich.table import Table

    from qfd.kernels.int8_triton import int8_matmul, pick_config, quantize_int8, reference_matmul
    from qfd.quant.head import quantize_head

    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    n, k, g = args.vocab, args.hidden, args.group_size
    weight = (torch.randn(n, k, device=dev) * 0.02).to(dtype)
    q8, s8 = quantize_int8(weight, g, scale_dtype=dtype)
    holder = torch.nn.Module()
    holder.lm_head = torch.nn.Linear(k, n, bias=False, device=dev, dtype=dtype)
    with torch.no_grad():
        holder.lm_head.weight.copy_(weight)
    int4 = quantize_head(holder, g, kernel="triton", bits=4)
    bytes_ = {"bf16": n * k * 2, "int8": n * k + s8.numel() * 2, "int4": n * k // 2 + n * (k // g) * 2}
    results = {"device": torch.cuda.get_device_name(), "vocab": n, "hidden": k, "group_size": g, "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, k, device=dev, dtype=dtype)
        out = {"bf16_ms": time_ms(lambda: torch.nn.functional.linear(x, weight))}
        ref = reference_matmul(x.float(), q8, s8.float())
        out["int8_max_abs_err_vs_fp32_reference"] = float((int8_matmul(x, q8, s8).float() - ref).abs().max())
        out["int8_default_ms"] = time_ms(lambda: int8_matmul(x, q8, s8))
        out["int8_default_config"] = repr(pick_config(rows))
        sweep = []
        for cfg in sweep_configs(rows):
            try:
                sweep.append((time_ms(lambda: int8_matmul(x, q8, s8, cfg), reps=3), repr(cfg)))
            except Exception as exc:  # a config that does not fit this GPU (shared memory, registers)
                sweep.append((float("inf"), f"{cfg!r}: {type(exc).__name__}"))
        sweep.sort()
        out["int8_sweep"] = [{"ms": ms, "config": c} for ms, c in sweep]
        out["int8_best_ms"], out["int8_best_config"] = sweep[0]
        out["int4_ms"] = time_ms(lambda: int4(x))
        results["rows"][rows] = out
        print(f"rows {rows}: best INT8 {sweep[0][1]} {sweep[0][0]:.3f} ms", flush=True)
    args.out.write_text(json.dumps(results, indent=2))

    table = Table(title=f"LM head {n} x {k} (group {g}), {results['device']}: ms per product (GB/s of weight bytes; x bf16)")
    for col in ("rows", "bf16 (cuBLAS)", "INT8 default", "INT8 best of sweep", "INT4 (Int4Linear triton)", "INT8 max |err| vs fp32 ref"):
        table.add_column(col, justify="right")
    for rows, o in results["rows"].items():
        def cell(ms, kind):
            return f"{ms:.3f} ({bytes_[kind] / ms / 1e6:.0f} GB/s; {o['bf16_ms'] / ms:.2f}x)"
        table.add_row(str(rows), cell(o["bf16_ms"], "bf16"), cell(o["int8_default_ms"], "int8"), cell(o["int8_best_ms"], "int8"),
                      cell(o["int4_ms"], "int4"), f"{o['int8_max_abs_err_vs_fp32_reference']:.2e}")
    Console(width=200).print(table)
    for rows, o in results["rows"].items():
        print(f"rows {rows}: best INT8 config {o['int8_best_config']}")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
