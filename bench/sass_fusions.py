"""Static SASS of the twenty-first session's two step fusions, without a GPU (as bench/sass_int4.py):

1. GATED INT4 products (an MLP's gate/up pair storing silu(gate) * up, `int4_triton`'s
   `_store_y`): each served kernel form of the gate/up shape compiled with and without the
   epilogue - the main loop must not change, only the code after it.
2. The Gated DeltaNet conv-step kernel reading its conv window channels first ([B, C, K-1+T]
   memory, the default) or channels last ([B, K-1+T, C] memory, `GatedDeltaNet._window` under
   QFD_GDN_WINDOW=channels_last): its global loads by width, instructions and registers.

    python bench/sass_fusions.py [--arch 90] [--out sass_fusions.json]

STATIC COUNTS, NOT TIMINGS: what the machine code issues; only a GPU run says what is faster
(bench/gpu_kernels_ab.sh VARIANTS="fused gated_mlp_off window_channels_last"; docs/benchmarks.md,
twenty-first session: the timings).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sass_int4 import compile_kernel, kernel_forms, main_loop_stats  # noqa: E402
from qfd.kernels import gdn_triton, int4_configs, int4_layout  # noqa: E402

GATE_UP = ("fused mlp gate_up", 18432, 2560)  # Qwen3.5-4B
GDN = dict(C=8192, KC=4, H=32, DK=128, DV=128, K_HEADS=16, AB_ROW=12352)  # Qwen3.5-4B's GDN layer
_GDN_POINTERS = ("win_ptr", "cw_ptr", "a_ptr", "b_ptr", "alog_ptr", "dtb_ptr", "o_ptr", "s_ptr", "start_ptr", "hist_ptr", "conv_ptr")


def gated_study(gpu: str, arch: int, rows=(1, 16, 32)) -> list[dict]:
    """Per row count and kernel form: registers, main-loop and whole-kernel instructions, plain vs GATED."""
    name, n, k = GATE_UP
    tuned = int4_configs.tuned_configs(gpu)
    out = []
    for m in rows:
        cfg = tuned.get((m if m == 1 else 16 if m <= 16 else 32, n, k)) or int4_configs.heuristic_config(m, n, k)
        values = {"M": m, "N": n, "K": k, "KT": -(-k // int4_layout.TILE_K), "stride_xm": k, "stride_ym": n // 2}
        for label, fn, args, constants, used, _ in kernel_forms(m, n, k, cfg):
            row = {"rows": m, "form": label}
            for gated in (False, True):
                sass, registers, _ = compile_kernel(fn, args, constants | {"GATED": gated}, used.num_warps, used.num_stages, arch, values)
                key = "gated" if gated else "plain"
                row[key] = {"registers": registers, "loop_instructions": main_loop_stats(sass).instructions, "instructions": _instructions(sass),
                            # global stores by width: the gated store must stay vectors (2-byte ones cost the 32-row form 30%)
                            "stores": dict(collections.Counter(re.findall(r"\b(STG\.E[.\w]*)", sass)).most_common())}
            out.append(row)
    return out


def window_study(arch: int, tokens=(1, 16)) -> list[dict]:
    """Per step length and window layout: the served (prefetching) conv-step kernel's global loads by width."""
    g = GDN
    args = {name: ("*fp32" if name in ("o_ptr", "s_ptr", "start_ptr", "hist_ptr") else "*bf16") for name in _GDN_POINTERS}
    args |= {name: "i32" for name in ("T", "H", "DV", "HIST_T", "C", "WB", "WC", "WW", "KD", "REP", "AB_ROW")} | {"scale": "fp32"}
    out = []
    for t in tokens:
        w = g["KC"] - 1 + t
        for layout, strides in (("channels first", (g["C"] * w, w, 1)), ("channels last", (g["C"] * w, 1, g["C"]))):
            values = {"T": t, "H": g["H"], "DV": g["DV"], "HIST_T": 16, "C": g["C"], "WB": strides[0], "WC": strides[1], "WW": strides[2],
                      "KD": g["K_HEADS"] * g["DK"], "REP": g["H"] // g["K_HEADS"], "AB_ROW": g["AB_ROW"]}
            constants = dict(DK=g["DK"], BV=gdn_triton.BLOCK_V, KC=g["KC"], KCP=4, ROUND=True, RECORDS=False, TP=max(1, 1 << (t - 1).bit_length()))
            sass, registers, _ = compile_kernel(gdn_triton._gated_delta_conv_prefetch_kernel, args, constants, gdn_triton.NUM_WARPS, 1, arch, values,
                                                pointers=_GDN_POINTERS)
            loads = collections.Counter(re.findall(r"\b(LDG\.E[.\w]*)", sass))
            opcodes = collections.Counter(op.split(".")[0] for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
            out.append({"tokens": t, "layout": layout, "registers": registers, "instructions": _instructions(sass), "global_loads": dict(loads.most_common()),
                        # layout conversions go through shared memory (STS/LDS + BAR); MUFU: the SiLU's exp and reciprocal
                        "opcodes": {op: opcodes[op] for op in ("STS", "LDS", "BAR", "MUFU", "SHFL")}})
    return out


def _widths(stores: dict) -> str:
    return ", ".join(f"{op.removeprefix('STG.E').lstrip('.') or '32'} x{n}" for op, n in stores.items())


def _instructions(sass: str) -> int:
    return len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))


def report(gated: list[dict], window: list[dict], arch: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"INT4 gate/up product {GATE_UP[1]}x{GATE_UP[2]}, plain vs GATED epilogue (sm_{arch}, STATIC SASS counts: not timings)")
    for col in ("rows", "form", "registers", "main-loop instr", "kernel instr", "global stores (plain -> gated)"):
        table.add_column(col, justify="left" if col == "form" else "right")
    for r in gated:
        p, g = r["plain"], r["gated"]
        table.add_row(str(r["rows"]), r["form"], f"{p['registers']} -> {g['registers']}", f"{p['loop_instructions']} -> {g['loop_instructions']}",
                      f"{p['instructions']} -> {g['instructions']}", f"{_widths(p['stores'])} -> {_widths(g['stores'])}")
    Console().print(table)
    table = Table(title=f"GDN conv-step kernel (prefetching form), window layouts (sm_{arch}, STATIC SASS counts: not timings)")
    for col in ("tokens", "window", "registers", "instructions", "global loads by width", "STS / LDS / BAR / MUFU / SHFL"):
        table.add_column(col, justify="right" if col in ("tokens", "registers", "instructions") else "left")
    for r in window:
        table.add_row(str(r["tokens"]), r["layout"], str(r["registers"]), str(r["instructions"]), ", ".join(f"{op} {n}" for op, n in r["global_loads"].items()),
                      " / ".join(str(n) for n in r["opcodes"].values()))
    Console().print(table)


def main() -> None:
    p = argparse.ArgumentParser(description="Static SASS counts of the gated INT4 epilogue and the GDN window layouts (no GPU)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 to compile for (default 90: H100/H200)")
    p.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", help="whose tuned table gives the INT4 launch configs")
    p.add_argument("--out", type=Path, default=Path("sass_fusions.json"))
    args = p.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("sass_fusions.py needs triton (pip install triton==3.6.0); no GPU is needed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("sass_fusions.py compiles the kernels: unset TRITON_INTERPRET (the interpreter has no machine code)")
    gated, window = gated_study(args.gpu, args.arch), window_study(args.arch)
    args.out.write_text(json.dumps({"arch": args.arch, "note": "static SASS counts, not timings", "gated": gated, "window": window}, indent=2))
    report(gated, window, args.arch)


if __name__ == "__main__":
    main()
