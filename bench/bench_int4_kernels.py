"""INT4 (W4A16, group 128) matmul kernels side by side at Qwen3.5-4B's linear shapes, for the
decode (1 row) and the 16-token verify (16 rows): bf16 dense (`F.linear`), torch's tinygemm
(`_weight_int4pack_mm`, what `Int4Linear` ran on CUDA so far) and qfd's Triton kernel
(`qfd.kernels.int4_triton`, with its heuristic launch config and the best of a small sweep).

Each kernel is timed the way the engine runs it: CALLS back-to-back calls captured in one CUDA
graph, replayed REPLAYS times; the figure is the median replay / CALLS (microseconds), so
launch overhead is out, as in a graphed step. The calls cycle through enough copies of the
weight that they stream from HBM, as a model's weights do in a decode (a weight read 20 times
in a row sits in the H200's 50 MB L2 and times 2-4x too fast); `--hot` times one copy, as
before 2026-12-05. Every Triton result is checked against the float32 reference on the same
packed layout (max |error| / max |reference|).

The shapes: every linear of a Qwen3.5-4B layer, the fused groups qfd runs (qfd.models.fuse:
gate+up, GDN qkv+z+b+a, attention q+k+v), the drafter's own and the 248K-row LM head.

    python bench/bench_int4_kernels.py [--rows 1,16] [--sweep] [--hot] [--out int4_kernels.json]
    python bench/bench_int4_kernels.py --ab [--rows 1,16,32]   # the served config vs its variants

--ab times, per shape and row count, the config Int4Linear serves (for 2+ rows of 16-bit x
`_int4_mma_kernel`, KernelConfig.mma16: pipelined loads, the weight built in 16 bits) against
the same launch through the older `_int4_mm_kernel` ("old") and that kernel's own options - the
16-bit MAGIC + u weight operand (KernelConfig.magic), the weights as the dot's first operand
(KernelConfig.w_first, also with the magic operand and with 8 warps) - programmatic dependent
launch on Hopper (KernelConfig.pdl), the tensor-core paths for one row, and for 17-32 rows two
16-row blocks instead of one 32-row block (each dequantizes the weight).

Needs CUDA (and Triton for the Triton rows).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qfd.kernels import int4_configs, int4_layout, int4_triton  # noqa: E402
from qfd.models.graphs import capture  # noqa: E402
from qfd.quant.grid import rtn_quantize  # noqa: E402
from qfd.quant.int4_linear import tinygemm_operands  # noqa: E402

# (name, out N, in K) of every linear in a Qwen3.5-4B layer (hidden 2560, MLP 9216; Gated
# DeltaNet: qkv 2*16*128 + 32*128, z 32*128; attention: gated q 2*16*256, kv 4*256)
SHAPES = (
    ("gdn in_proj_qkv", 8192, 2560), ("gdn in_proj_z", 4096, 2560), ("gdn out_proj", 2560, 4096),
    ("attn q_proj (gated)", 8192, 2560), ("attn k/v_proj", 1024, 2560), ("attn o_proj", 2560, 4096),
    ("mlp gate/up_proj", 9216, 2560), ("mlp down_proj", 2560, 9216),
    ("fused gdn in_proj", 12352, 2560), ("fused attn qkv", 10240, 2560), ("fused mlp gate_up", 18432, 2560),
    # the 5-layer DFlash drafter's own shapes (its q is 4096x2560, o/gate_up/down as the target's)
    ("drafter kv (fused)", 2048, 2560), ("drafter fc (5 taps)", 2560, 12800),
    ("lm_head", 248320, 2560),
)
UNFUSED = 8  # the first SHAPES are the unfused layer's (summed as before)
CALLS, REPLAYS = 20, 15
L2_BYTES = 50 * 2**20  # H200; the copies of a weight cover 3x this


def copies_for(nbytes: int, hot: bool) -> int:
    """Weight copies to cycle through so consecutive calls miss L2 (1 when `hot`)."""
    return 1 if hot else max(1, min(CALLS, -(-3 * L2_BYTES // nbytes)))


def graph_time_us(fns) -> float:
    """Median per-call time of CALLS calls cycling through `fns` (one per weight copy), replayed
    inside one CUDA graph (captured as the engine captures its steps: `qfd.models.graphs.capture`)."""
    fns = fns if isinstance(fns, (list, tuple)) else [fns]
    graph, _ = capture(lambda: [fns[i % len(fns)]() for i in range(CALLS)])
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def sweep_configs(m: int, grid: str = "full"):
    """The launch configs tried per shape: for 1 row the GEMV kernel's block / tiles per step /
    split / warps / pipeline stages (offset-sum arithmetic; the best is re-timed with the exact
    one) and the generic kernel's CUDA-core path; the tensor-core path otherwise.
    grid "split": the served kernel only, over outputs per program, deeper K splits and warps
    (one row) or splits and stages (16 rows): ~56 compiles in all, as N and K are not compile-time
    constants, so one device call can sweep every shape.
    grid "mma16": the "split" grid plus `_int4_mma_kernel` (KernelConfig.mma16) over outputs per
    program (64 on 4 warps, 128 on 4 or 8), splits and stages - for one row too, as a 16-row block - so the tuned table keeps,
    per shape, whichever kernel is faster.
    grid "gemv" (one row): the "split" grid plus `_int4_gemv_kernel` with offset-sum arithmetic
    over outputs per program, K tiles per step and splits, and a few `_int4_mma_kernel` blocks.
    grid "two_slot" (one row): `_int4_gemv_two_slot_kernel` over outputs per program, tiles per
    step, warps and splits; the sweep adds the served config, so the table keeps the faster."""
    block_m = 32 if m > 16 else 16  # 17-32 rows as one 32-row block, as the heuristic runs them
    if grid == "mma16":  # the served splits through the older kernel, named so the table records which won
        yield from (replace(c, mma16=False) if c.use_dot else c for c in sweep_configs(m, "split"))
        # 128 outputs on 4 warps (fewest instructions per weight, 157-191 registers) and on 8
        # (two warpgroups: 64 each, the registers of 64 on 4 warps)
        for (bn, warps), split, stages in itertools.product(((64, 4), (128, 4), (128, 8)), (2, 4, 8, 16), (2, 3)):
            yield int4_configs.KernelConfig(use_dot=True, block_n=bn, split_k=split, num_warps=warps, num_stages=stages, block_m=block_m, mma16=True)
        return
    if grid == "two_slot":  # one row: `_int4_gemv_two_slot_kernel` (the sweep times the served config beside it)
        for (bn, tiles, warps), split in itertools.product(((32, 1, 4), (64, 1, 4), (128, 1, 4), (128, 1, 8), (32, 2, 4), (64, 2, 4)), (2, 4, 8, 16)):
            yield int4_configs.KernelConfig(use_dot=False, block_n=bn, split_k=split, num_warps=warps, tiles=tiles, two_slot=True)
        return
    if grid == "gemv":  # one row: the served splits and `_int4_gemv_kernel` (offset-sum arithmetic)
        yield from sweep_configs(m, "split")
        for (bn, tiles), split in itertools.product(((64, 1), (128, 1), (64, 2), (32, 2)), (2, 4, 8, 16)):
            yield int4_configs.KernelConfig(use_dot=False, block_n=bn, split_k=split, num_warps=4, tiles=tiles, offset_sum=True)
        for bn, split in ((64, 4), (64, 8), (128, 4)):  # and `_int4_mma_kernel` as a 16-row block
            yield int4_configs.KernelConfig(use_dot=True, block_n=bn, split_k=split, num_warps=4, num_stages=2, mma16=True)
        return
    if grid == "split":
        if m == 1:
            for bn, split, warps in itertools.product((16, 32, 64, 128), (2, 4, 8, 16, 32), (2, 4)):
                yield int4_configs.KernelConfig(use_dot=False, block_n=bn, split_k=split, num_warps=warps)
        else:
            for bn, split, stages in itertools.product((64, 128), (2, 4, 8, 16), (2, 3)):
                yield int4_configs.KernelConfig(use_dot=True, block_n=bn, split_k=split, num_warps=4, num_stages=stages, block_m=block_m)
        return
    if m == 1:
        for (bn, tiles), split, warps, stages in itertools.product(
            ((32, 1), (64, 1), (128, 1), (32, 2), (64, 2), (128, 2), (32, 4), (64, 4)), (1, 2, 4, 8), (4, 8), (1, 3)
        ):
            yield int4_configs.KernelConfig(use_dot=False, block_n=bn, split_k=split, num_warps=warps, num_stages=stages, tiles=tiles, offset_sum=True)
        for bn, split in itertools.product((64, 128), (1, 4, 8)):
            yield int4_configs.KernelConfig(use_dot=False, block_n=bn, split_k=split)
    else:
        for bn, split, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (1, 2)):
            yield int4_configs.KernelConfig(use_dot=True, block_n=bn, split_k=split, num_warps=4, num_stages=stages, block_m=block_m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16", help="comma-separated row counts M")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--sweep", action="store_true", help="also try a grid of Triton launch configs per shape")
    p.add_argument("--sweep-grid", choices=("full", "split", "mma16", "gemv", "two_slot"), default="full", help="with --sweep: the full grid (GEMV kernel variants; compiles per config), the served kernel's splits only (fast), those and _int4_mma_kernel's, (one row) those and _int4_gemv_kernel's offset-sum configs, or (one row) _int4_gemv_two_slot_kernel's configs beside the served one")
    p.add_argument("--hot", action="store_true", help="time one weight copy (L2-resident) instead of cycling through HBM-sized copies")
    p.add_argument("--shapes", default="", help="comma-separated substrings: only the shapes whose name has one")
    p.add_argument("--write-tuned", nargs="?", const="", default=None, metavar="PATH",
                   help="with --sweep: write each shape's best config as the GPU's tuned table, which Int4Linear's "
                        "Triton kernel then uses (default PATH: qfd/kernels/tuned/<GPU name>.json)")
    p.add_argument("--ab-knobs", type=Path, default=None, metavar="JSON", help="print the shell exports (QFD_INT4_MAGIC, QFD_INT4_BM32) of the variants that won in a saved --ab run, and exit")
    p.add_argument("--ab-only", default="", metavar="LABELS", help="with --ab: time only these comma-separated variants beside the served config (e.g. mma16,mma16 s3)")
    p.add_argument("--ab", action="store_true", help="the served config against its variants (magic operand, dot for one row, 32-row blocks), side by side")
    p.add_argument("--gated", action="store_true", help="also the served config as a GATED product (silu(gate) * up stored by the kernel, an MLP's fused gate/up) against the plain product then the activation compiled by torch.compile, side by side")
    p.add_argument("--out", type=Path, default=Path("int4_kernels.json"))
    args = p.parse_args()
    ab_only = {label.strip() for label in args.ab_only.split(",") if label.strip()}
    if args.ab_knobs:
        print(" ".join(f"export {key}={value};" for key, value in ab_knobs(json.loads(args.ab_knobs.read_text())["rows"]).items()))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_int4_kernels.py: needs a CUDA device")
    rows_list = [int(r) for r in args.rows.split(",")]
    have_triton = int4_triton.available()
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "group_size": args.group_size, "calls_per_graph": CALLS,
               "weights": "one copy, L2-hot" if args.hot else "cycled copies over 3x L2 (HBM-streamed)", "rows": [], "sweep": []}
    wanted = [w for w in args.shapes.split(",") if w]
    shapes = [sh for sh in SHAPES if not wanted or any(w in sh[0] for w in wanted)]

    def save():
        args.out.write_text(json.dumps(results, indent=2))

    for (name, n, k), m in itertools.product(shapes, rows_list):
        w = torch.randn(n, k, device=dev) * 0.02
        qw = rtn_quantize(w, args.group_size, scale_dtype=dtype)
        del w
        x = torch.randn(m, k, device=dev, dtype=dtype)
        dense = qw.codes.float().sub(0 if qw.zeros is None else qw.zeros.float().repeat_interleave(args.group_size, 1))
        dense = (dense * qw.scales.float().repeat_interleave(args.group_size, 1)).to(dtype)
        row = {"shape": name, "n": n, "k": k, "m": m, "weight_mb_int4": n * k / 2 / 1e6}
        copies = [dense] + [dense.clone() for _ in range(copies_for(dense.numel() * 2, args.hot) - 1)]
        row["bf16_us"] = graph_time_us([lambda d=d: F.linear(x, d) for d in copies])
        del copies
        u, sz = tinygemm_operands(qw)
        packed_tg = torch.ops.aten._convert_weight_to_int4pack(((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8).to(dev), 8)
        sz = sz.to(device=dev, dtype=dtype)
        del u
        n_int4 = copies_for(packed_tg.numel() * packed_tg.element_size(), args.hot)
        copies = [packed_tg] + [packed_tg.clone() for _ in range(n_int4 - 1)]
        row["tinygemm_us"] = graph_time_us([lambda p=p: torch.ops.aten._weight_int4pack_mm(x, p, args.group_size, sz) for p in copies])
        del copies, packed_tg
        if have_triton:
            packed = int4_layout.pack_for_triton(qw, dev, scale_dtype=dtype)
            packs = [packed] + [replace(packed, qweight=packed.qweight.clone(), scales=packed.scales.clone()) for _ in range(n_int4 - 1)]
            ref = int4_layout.reference_matmul(x, packed).float() if n * k <= 2**27 else None  # the head's float32 reference would take 2.5 GB

            def timed(cfg=None, rel_err_key=None):
                if rel_err_key and ref is not None:
                    got = int4_triton.int4_matmul(x, packed, config=cfg).float()
                    row[rel_err_key] = float((got - ref).abs().max() / ref.abs().max())
                return graph_time_us([lambda p=p: int4_triton.int4_matmul(x, p, config=cfg) for p in packs])

            row["triton_us"] = timed(None, "triton_rel_err")
            row["triton_config"] = vars(int4_configs.pick_config(m, n, k, x.device))  # the config timed just above
            if args.gated and n % 2 == 0:
                row.update(gated_timings(x, packs, ref))
            if args.ab:
                by_config: dict[int4_configs.KernelConfig, dict] = {}  # a variant that is the served config is timed once

                def variant(cfg):
                    if cfg not in by_config:
                        by_config[cfg] = {"us": timed(cfg, "rel_err"), "rel_err": row.pop("rel_err", None)}
                    return {**by_config[cfg], **vars(cfg)}

                row["variants"] = {label: variant(cfg) for label, cfg in ab_variants(m, n, k) if label == "served" or not ab_only or label in ab_only}
            if args.sweep:
                best = None
                grid = sweep_configs(m, args.sweep_grid)
                if args.sweep_grid == "two_slot":  # a grid of the new kernel alone: the served config competes too
                    grid = itertools.chain([int4_configs.pick_config(m, n, k, x.device)], grid)
                for cfg in grid:
                    if cfg.split_k > -(-k // int4_layout.TILE_K):
                        continue  # more splits than K tiles: idle programs
                    try:
                        t = timed(cfg)
                    except Exception as e:  # a config the compiler rejects (shared memory, registers): skip it
                        print(f"  {name} m={m} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    results["sweep"].append({"shape": name, "m": m, "us": t, **vars(cfg)})
                    if best is None or t < best[0]:
                        best = (t, cfg)
                row["triton_best_us"], row["triton_best_config"] = best[0], vars(best[1])
                if best[1].offset_sum:  # the same launch with exact (q - z) arithmetic, and both errors
                    exact = replace(best[1], offset_sum=False)
                    row["triton_best_exact_us"] = timed(exact, "triton_best_exact_rel_err")
                    timed(best[1], "triton_best_rel_err")
                    if row["triton_best_exact_us"] <= best[0]:  # exact and no slower: prefer it
                        row["triton_best_us"], row["triton_best_config"] = row["triton_best_exact_us"], vars(exact)
                else:  # the winner's error too (a kernel form the served config does not use, e.g. mma16)
                    timed(best[1], "triton_best_rel_err")
            del packs, packed
        results["rows"].append(row)
        save()
        if args.write_tuned is not None and args.sweep:
            write_tuned(args.write_tuned, results)
        print(f"{name} m={m}: " + ", ".join(f"{key} {row[key]:.2f}" for key in ("bf16_us", "tinygemm_us", "triton_us", "triton_best_us") if key in row), flush=True)

    from rich.console import Console
    from rich.table import Table

    if args.ab:
        ab_table(results["rows"])
    table = Table(title=f"INT4 W4A16 matmul, us per call inside a CUDA graph ({results['device']}, group {args.group_size}); x = vs bf16")
    for col in ("linear", "N x K", "rows", "bf16", "tinygemm", "triton", "triton best (sweep)", "triton rel err"):
        table.add_column(col, justify="right")
    totals = {}
    for r in results["rows"]:
        def cell(key):
            return f"{r[key]:.1f} ({r['bf16_us'] / r[key]:.2f}x)" if key in r else "-"

        for key in ("bf16_us", "tinygemm_us", "triton_us", "triton_best_us"):
            if key in r and any(r["shape"] == sh[0] for sh in SHAPES[:UNFUSED]):
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
    for r in results["rows"]:
        if "triton_best_us" in r:
            nbytes = r["n"] * r["k"] / 2 + r["n"] * r["k"] / args.group_size * 2  # codes + bf16 scales
            gbps = nbytes / (r["triton_best_us"] * 1e-6) / 1e9
            exact = f", exact arithmetic {r['triton_best_exact_us']:.2f} us" if "triton_best_exact_us" in r else ""
            print(f"  best {r['shape']} m={r['m']}: {r['triton_best_us']:.2f} us ({gbps:.0f} GB/s of codes + scales){exact}: {r['triton_best_config']}")
    for r in results["rows"]:
        if "gated_us" in r:
            print(f"  gated {r['shape']} m={r['m']}: {r['gated_us']:.2f} us vs plain {r['triton_us']:.2f} + activation = {r['plain_act_us']:.2f} us "
                  f"(activation alone {r['act_us']:.2f}): {r['plain_act_us'] / r['gated_us']:.2f}x, rel err {r.get('gated_rel_err', float('nan')):.1e}")
    for m, cfg, total in best_single_configs(results["sweep"]):
        print(f"rows={m}: best single config over all swept shapes: {total:.1f} us in all, {cfg}")
    results["best_single"] = [{"m": m, "sum_us": total, **cfg} for m, cfg, total in best_single_configs(results["sweep"])]
    save()
    if args.write_tuned is not None and args.sweep:
        print(f"tuned configs for {results['device']}: {write_tuned(args.write_tuned, results)}")


def gated_timings(x: torch.Tensor, packs: list, ref: torch.Tensor | None) -> dict:
    """A gate/up product's two ways, us per call in a CUDA graph: GATED (the kernel stores
    silu(gate) * up) and the plain product then the activation as torch.compile fuses it (one
    kernel: how a compiled step runs an MLP without the gated product), and the activation alone."""
    act = torch.compile(int4_layout.silu_mul_interleaved)
    plain = int4_triton.int4_matmul(x, packs[0])
    act(plain)  # compile outside the graph
    out = {"gated_us": graph_time_us([lambda p=p: int4_triton.int4_matmul(x, p, gated=True) for p in packs]),
           "plain_act_us": graph_time_us([lambda p=p: act(int4_triton.int4_matmul(x, p)) for p in packs]),
           "act_us": graph_time_us(lambda: act(plain))}
    if ref is not None:
        want = int4_layout.silu_mul_interleaved(ref)
        got = int4_triton.int4_matmul(x, packs[0], gated=True).float()
        out["gated_rel_err"] = float((got - want).abs().max() / want.abs().max())
    return out


def ab_variants(m: int, n: int, k: int):
    """(label, KernelConfig) of what --ab times against the served config (label "served")."""
    served = int4_configs.pick_config(m, n, k, torch.device("cuda"))
    if served.use_dot and served.mma16 is None:  # the kernel it runs, named: the "mma16" or "old" variant is then the same config
        served = replace(served, mma16=int4_configs.MMA16)
    yield "served", served
    if torch.cuda.get_device_capability()[0] >= 9:  # programmatic dependent launch (QFD_INT4_PDL=1)
        yield "pdl", replace(served, pdl=True)
    if served.use_dot:
        # the older tensor-core kernel (`_int4_mm_kernel`, the default before 2026-12-06: QFD_INT4_MMA16=0)
        # and its own variants, pinned to it: 16-bit x goes to `_int4_mma_kernel` by default
        old = replace(served, mma16=False)
        yield "old", old
        yield "magic", replace(old, magic=True)
        # the weights as the dot's first operand (QFD_INT4_WFIRST=1), exact and magic, and with
        # two warpgroups
        yield "wfirst", replace(old, w_first=True, magic=False)
        yield "wfirst+magic", replace(old, w_first=True, magic=True)
        yield "wfirst w8", replace(old, w_first=True, magic=False, num_warps=8)
        # `_int4_mma_kernel` (the default: pipelined loads, the weight built exactly in 16 bits),
        # also with 3 stages and with 64 outputs a program
        yield "mma16", replace(served, mma16=True)
        yield "mma16 s3", replace(served, mma16=True, num_stages=3)
        yield "mma16 bn64", replace(served, mma16=True, block_n=64)
    if m == 1:  # the two-slot gemv at the served outputs per program and split (QFD_INT4_GEMV=two_slot)
        yield "two_slot", int4_configs.as_two_slot(served)
    if m == 1:  # the tensor-core path for one row (15 of its 16 rows masked), exact and magic
        dot = int4_configs.heuristic_config(16, n, k)
        yield "dot", replace(dot, magic=False, mma16=False)
        yield "dot+magic", replace(dot, magic=True, mma16=False)
        yield "dot+mma16", replace(dot, mma16=True)
    if 16 < m <= 32:  # two 16-row blocks, each dequantizing the whole weight (QFD_INT4_BM32=0)
        yield "bm16", replace(served, block_m=16)


def ab_knobs(rows: list[dict], margin: float = 0.97) -> dict[str, int]:
    """The INT4 variants an --ab run says to serve with, as environment settings. Each default
    holds unless its alternative's time, summed over the row counts both ran at, is under
    `margin` x the default's: `_int4_mma_kernel` (QFD_INT4_MMA16) against the older kernel at 16
    and 32 rows; 32-row blocks (QFD_INT4_BM32) against two 16-row blocks at 32 rows. The magic
    operand (QFD_INT4_MAGIC, the older kernel's only) is on where it beats that kernel's exact one."""
    def total(m, label):
        entries = [r["variants"] for r in rows if r["m"] == m and "variants" in r]
        return sum(e[label]["us"] for e in entries) if entries and all(label in e for e in entries) else None

    def faster(label, than):  # like for like: the row counts both ran at
        timed = [m for m in (16, 32) if total(m, label) is not None and total(m, than) is not None]
        return bool(timed) and sum(total(m, label) for m in timed) < margin * sum(total(m, than) for m in timed)

    return {"QFD_INT4_MAGIC": int(faster("magic", "old")), "QFD_INT4_BM32": int(not faster("bm16", "served")),
            "QFD_INT4_MMA16": int(not faster("old", "mma16"))}


def ab_table(rows: list[dict]) -> None:
    """Per row count: each variant's us per shape and summed over the fused shapes qfd runs, x the served config."""
    from rich.console import Console
    from rich.table import Table

    for m in sorted({r["m"] for r in rows if "variants" in r}):
        of_m = [r for r in rows if r["m"] == m and "variants" in r]
        labels = list(dict.fromkeys(label for r in of_m for label in r["variants"]))
        table = Table(title=f"INT4 kernel variants, {m} row(s): us per call in a CUDA graph (x served); rel err vs the float32 reference")
        for col in ("linear", "N x K", *labels):
            table.add_column(col, justify="right")
        totals = dict.fromkeys(labels, 0.0)
        for r in of_m:
            base = r["variants"]["served"]["us"]
            cells = []
            for label in labels:
                v = r["variants"].get(label)
                if v is None:
                    cells.append("-")
                    continue
                cells.append(f"{v['us']:.1f} ({base / v['us']:.2f}x)" + (f" {v['rel_err']:.0e}" if v["rel_err"] is not None else ""))
                if r["shape"] not in [sh[0] for sh in SHAPES[:UNFUSED]] and r["shape"] != "lm_head":
                    totals[label] += v["us"]
            table.add_row(r["shape"], f"{r['n']}x{r['k']}", *cells)
        for label in labels:  # a sum over only some shapes compares nothing
            if any(label not in r["variants"] for r in of_m):
                totals[label] = 0.0
        if totals["served"]:
            table.add_row("sum: fused + drafter shapes", "", *(f"{totals[label]:.1f} ({totals['served'] / totals[label]:.2f}x)" if totals[label] else "-" for label in labels))
        Console().print(table)


def write_tuned(where: str, results: dict) -> str:
    """The sweep's best config per (rows, N, K) as the GPU's tuned table (`where`, or
    int4_configs.tuned_file of the GPU when empty); rewritten after every shape, so a sweep cut
    short by a time limit still leaves what it found. Entries of the table already there that
    this run did not time (other row counts or shapes) are kept, so a sweep of 16 rows alone
    does not drop the one-row entries."""
    path = Path(where) if where else int4_configs.tuned_file(results["device"])
    kept = json.loads(path.read_text())["configs"] if path.is_file() else []
    best: dict[tuple, dict] = {}  # two linears of one shape (o_proj, out_proj): one entry, the faster
    for r in results["rows"]:
        if "triton_best_config" in r and r["m"] in (1, 16, 32):
            entry = {"m": r["m"], "n": r["n"], "k": r["k"], "us": round(r["triton_best_us"], 2), **r["triton_best_config"]}
            key = (r["m"], r["n"], r["k"])
            if key not in best or entry["us"] < best[key]["us"]:
                best[key] = entry
    entries = [e for e in kept if (e["m"], e["n"], e["k"]) not in best] + list(best.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": results["device"], "torch": results["torch"], "weights": results["weights"], "configs": entries}, indent=1) + "\n")
    return f"{path} ({len(entries)} shapes)"


def best_single_configs(sweep: list[dict]):
    """(m, config, summed us) of the config fastest summed over every shape it ran on, per row
    count (only configs that ran on every shape of that row count)."""
    for m in sorted({e["m"] for e in sweep}):
        entries = [e for e in sweep if e["m"] == m]
        shapes = {e["shape"] for e in entries}
        sums: dict[tuple, list] = {}
        for e in entries:
            key = tuple((k, v) for k, v in e.items() if k not in ("shape", "us"))
            sums.setdefault(key, []).append(e["us"])
        full = {key: sum(v) for key, v in sums.items() if len(v) == len(shapes)}
        if full:
            key = min(full, key=full.get)
            yield m, {k: v for k, v in key if k != "m"}, full[key]


if __name__ == "__main__":
    main()
