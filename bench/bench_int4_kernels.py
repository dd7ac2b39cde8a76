"""INT4 (W4A16, group 128) matmul kernels side by side at Qwen3.5-4B's linear shapes, for the
decode (1 row) and the 16-token verify (16 rows): bf16 dense (`F.linear`), torch's tinygemm
(`_weight_int4pack_mm`, what `Int4Linear` ran on CUDA so far) and qfd's Triton kernel
(`qfd.kernels.int4_triton`, with its heuristic launch config and the best of a small sweep).

Each kernel is timed the way the engine runs it: CALLS back-to-back calls captured in one CUDA
graph, replayed REPLAYS times; the figure is the median replay / CALLS (microseconds), so
launch overhead is out, as in a graphed step. Every Triton result is checked against the
float32 reference on the same packed layout (max |error| / max |reference|).

    python bench/bench_int4_kernels.py [--rows 1,16] [--sweep] [--out int4_kernels.json]

Needs CUDA (and Triton for the Triton rows).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qfd.kernels import int4_triton  # noqa: E402
from qfd.models.graphs import capture  # noqa: E402
from qfd.quant.grid import rtn_quantize  # noqa: E402
from qfd.quant.int4_linear import tinygemm_operands  # noqa: E402

# (name, out N, in K) of every linear in a Qwen3.5-4B layer (hidden 2560, MLP 9216; Gated
# DeltaNet: qkv 2*16*128 + 32*128, z 32*128; attention: gated q 2*16*256, kv 4*256)
SHAPES = (
    ("gdn in_proj_qkv", 8192, 2560), ("gdn in_proj_z", 4096, 2560), ("gdn out_proj", 2560, 4096),
    ("attn q_proj (gated)", 8192, 2560), ("attn k/v_proj", 1024, 2560), ("attn o_proj", 2560, 4096),
    ("mlp gate/up_proj", 9216, 2560), ("mlp down_proj", 2560, 9216),
)
CALLS, REPLAYS = 20, 15


def graph_time_us(fn) -> float:
    """Median per-call time of `fn` replayed inside one CUDA graph of CALLS calls (captured as
    the engine captures its steps: `qfd.models.graphs.capture`)."""
    graph, _ = capture(lambda: [fn() for _ in range(CALLS)])
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def sweep_configs(m: int):
    """The launch configs tried per shape (GEMV path for 1 row, tensor-core path otherwise)."""
    if m == 1:
        for bn, split, warps in itertools.product((64, 128, 256), (1, 2, 4, 8), (2, 4)):
            yield int4_triton.KernelConfig(use_dot=False, block_n=bn, split_k=split, num_warps=warps)
    else:
        for bn, split, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (1, 2)):
            yield int4_triton.KernelConfig(use_dot=True, block_n=bn, split_k=split, num_warps=4, num_stages=stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16", help="comma-separated row counts M")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--sweep", action="store_true", help="also try a grid of Triton launch configs per shape")
    p.add_argument("--out", type=Path, default=Path("int4_kernels.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_int4_kernels.py: needs a CUDA device")
    rows_list = [int(r) for r in args.rows.split(",")]
    have_triton = int4_triton.available()
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "group_size": args.group_size, "calls_per_graph": CALLS, "rows": []}

    def save():
        args.out.write_text(json.dumps(results, indent=2))

    for (name, n, k), m in itertools.product(SHAPES, rows_list):
        w = torch.randn(n, k, device=dev) * 0.02
        qw = rtn_quantize(w, args.group_size, scale_dtype=dtype)
        x = torch.randn(m, k, device=dev, dtype=dtype)
        dense = qw.codes.float().sub(0 if qw.zeros is None else qw.zeros.float().repeat_interleave(args.group_size, 1))
        dense = (dense * qw.scales.float().repeat_interleave(args.group_size, 1)).to(dtype)
        row = {"shape": name, "n": n, "k": k, "m": m, "weight_mb_int4": n * k / 2 / 1e6}
        row["bf16_us"] = graph_time_us(lambda: F.linear(x, dense))
        u, sz = tinygemm_operands(qw)
        packed_tg = torch.ops.aten._convert_weight_to_int4pack(((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8), 8)
        sz = sz.to(dtype)
        row["tinygemm_us"] = graph_time_us(lambda: torch.ops.aten._weight_int4pack_mm(x, packed_tg, args.group_size, sz))
        if have_triton:
            packed = int4_triton.pack_for_triton(qw, dev, scale_dtype=dtype)
            ref = int4_triton.reference_matmul(x, packed).float()
            got = int4_triton.int4_matmul(x, packed).float()
            row["triton_rel_err"] = float((got - ref).abs().max() / ref.abs().max())
            row["triton_us"] = graph_time_us(lambda: int4_triton.int4_matmul(x, packed))
            row["triton_config"] = vars(int4_triton.pick_config(m, n, k))
            if args.sweep:
                best = None
                for cfg in sweep_configs(m):
                    try:
                        t = graph_time_us(lambda: int4_triton.int4_matmul(x, packed, config=cfg))
                    except Exception as e:  # a config the compiler rejects (shared memory): skip it
                        print(f"  {name} m={m} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                row["triton_best_us"], row["triton_best_config"] = best[0], vars(best[1])
        results["rows"].append(row)
        save()
        print(f"{name} m={m}: " + ", ".join(f"{key} {row[key]:.2f}" for key in ("bf16_us", "tinygemm_us", "triton_us", "triton_best_us") if key in row), flush=True)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"INT4 W4A16 matmul, us per call inside a CUDA graph ({results['device']}, group {args.group_size}); x = vs bf16")
    for col in ("linear", "N x K", "rows", "bf16", "tinygemm", "triton", "triton best (sweep)", "triton rel err"):
        table.add_column(col, justify="right")
    totals = {}
    for r in results["rows"]:
        def cell(key):
            return f"{r[key]:.1f} ({r['bf16_us'] / r[key]:.2f}x)" if key in r else "-"

        for key in ("bf16_us", "tinygemm_us", "triton_us", "triton_best_us"):
            if key in r:
                totals.setdefault((r["m"], key), 0.0)
                totals[(r["m"], key)] += r[key] * (2 if r["shape"].startswith("mlp gate") else 1)
        table.add_row(r["shape"], f"{r['n']}x{r['k']}", str(r["m"]), f"{r['bf16_us']:.1f}", cell("tinygemm_us"), cell("triton_us"), cell("triton_best_us"),
                      f"{r['triton_rel_err']:.1e}" if "triton_rel_err" in r else "-")
    Console().print(table)
    # one GDN layer + one attention layer's worth is not what a model runs: sum each row count's
    # shapes as listed (gate/up twice), a fixed mix to compare the kernels by
    results["sum_us"] = {f"m{m}_{key}": v for (m, key), v in totals.items()}
    save()
    for m in rows_list:
        parts = {key: totals.get((m, key)) for key in ("bf16_us", "tinygemm_us", "triton_us", "triton_best_us")}
        print(f"rows={m}: sum over the listed linears (gate/up twice): " + ", ".join(f"{key[:-3]} {v:.1f} us" for key, v in parts.items() if v))


if __name__ == "__main__":
    main()
