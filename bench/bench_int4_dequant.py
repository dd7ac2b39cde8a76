"""Long-prompt INT4 linears (prefill): what Int4Linear's "triton" mode costs vs a bf16 layer,
at Qwen3.5-4B's linear shapes (W4A16, group 128, bf16 scales).

Per shape and row count (microseconds per call, median of RUNS single calls timed with CUDA
events after WARMUP calls; calls of this size need no graph to hide launch overhead):
  bf16       F.linear with a dense bf16 weight (what the unquantized model runs)
  int4       Int4Linear(kernel="triton") as wired: up to KERNEL_MAX_ROWS["triton"] rows the
             Triton W4A16 matmul, beyond that qfd.kernels.int4_dequant's kernel + x @ w_t (cuBLAS)
  dequant    that dequant kernel alone (w_t [K, N] bf16), with its bandwidth
  old        the path it replaced: int4_layout.dequantize_packed (torch ops) + F.linear
Also checks the int4 layer against the old path's output (max |diff| / max |old|).

    python bench/bench_int4_dequant.py [--rows 64,256,1024,2048] [--out int4_dequant.json]

Needs CUDA and Triton. The weight is the same one every call (L2-resident where it fits: the
50 MB L2 of an H200 holds a 12 MB INT4 weight, a 47 MB bf16 one only partly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qfd.kernels import int4_layout, int4_triton  # noqa: E402
from qfd.kernels.int4_dequant import int4_dequant_op  # noqa: E402
from qfd.quant.grid import rtn_quantize  # noqa: E402
from qfd.quant.int4_linear import KERNEL_MAX_ROWS, Int4Linear  # noqa: E402

# (name, out N, in K): Qwen3.5-4B's distinct linear shapes (hidden 2560, MLP 9216)
SHAPES = (
    ("gdn in_proj_qkv / attn q_proj", 8192, 2560), ("gdn in_proj_z", 4096, 2560), ("o_proj / gdn out_proj", 2560, 4096),
    ("mlp gate/up_proj", 9216, 2560), ("mlp down_proj", 2560, 9216),
)
GROUP = 128
WARMUP, RUNS = 5, 20


def time_us(fn) -> float:
    """Median microseconds of RUNS calls of `fn`, each between two CUDA events, after WARMUP calls."""
    for _ in range(WARMUP):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(RUNS)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256,1024,2048", help="comma-separated row counts M")
    p.add_argument("--out", type=Path, default=Path("int4_dequant.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_int4_dequant.py: needs a CUDA device")
    if not int4_triton.available():
        sys.exit("bench_int4_dequant.py: needs Triton (Int4Linear's 'triton' mode)")
    rows_list = [int(r) for r in args.rows.split(",")]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "group_size": GROUP, "runs": RUNS,
               "kernel_max_rows": KERNEL_MAX_ROWS["triton"], "rows": []}

    for name, n, k in SHAPES:
        qw = rtn_quantize(torch.randn(n, k, device=dev) * 0.02, GROUP, scale_dtype=dtype)
        packed = int4_layout.pack_for_triton(qw, dev, scale_dtype=dtype)
        layer = Int4Linear(qw, device=dev, dtype=dtype, kernel="triton")
        assert layer.mode == "triton", layer.mode
        dense = int4_layout.dequantize_packed(packed, dtype)
        op_args = (packed.qweight, packed.scales, packed.zeros, GROUP, k, dtype)
        dequant_us = time_us(lambda: int4_dequant_op(*op_args))
        nbytes = packed.nbytes() + n * k * 2  # codes + scales in, bf16 w_t out
        for m in rows_list:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            row = {"shape": name, "n": n, "k": k, "m": m, "dequant_us": dequant_us, "dequant_gbps": nbytes / (dequant_us * 1e-6) / 1e9}
            row["bf16_us"] = time_us(lambda: F.linear(x, dense))
            row["int4_us"] = time_us(lambda: layer(x))
            row["old_us"] = time_us(lambda: F.linear(x, int4_layout.dequantize_packed(packed, dtype)))
            old = F.linear(x, int4_layout.dequantize_packed(packed, dtype)).float()
            row["int4_rel_err_vs_old"] = float((layer(x).float() - old).abs().max() / old.abs().max())
            results["rows"].append(row)
            args.out.write_text(json.dumps(results, indent=2))
            print(f"{name} {n}x{k} m={m}: bf16 {row['bf16_us']:.1f}, int4 {row['int4_us']:.1f}, old {row['old_us']:.1f} us", flush=True)
        del layer, dense, packed, qw

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"INT4 linears at prefill sizes, us per call ({results['device']}, group {GROUP}); x = time / bf16's")
    for col in ("linear", "N x K", "rows", "bf16", "int4 (as wired)", "old (torch dequant)", "dequant kernel", "int4 rel err"):
        table.add_column(col, justify="right")
    for r in results["rows"]:
        def cell(key):
            return f"{r[key]:.1f} ({r[key] / r['bf16_us']:.2f}x)"

        table.add_row(r["shape"], f"{r['n']}x{r['k']}", str(r["m"]), f"{r['bf16_us']:.1f}", cell("int4_us"), cell("old_us"),
                      f"{r['dequant_us']:.1f} ({r['dequant_gbps']:.0f} GB/s)", f"{r['int4_rel_err_vs_old']:.1e}")
    Console().print(table)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
