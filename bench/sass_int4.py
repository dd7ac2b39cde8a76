"""Static SASS study of the INT4 matmul kernels, without a GPU: compile each kernel form for a
GPU architecture (default sm_90, the H100/H200) with Triton's bundled ptxas, disassemble it with
its cuobjdump, and count what one trip of the main loop (one K tile) issues per weight.

    python bench/sass_int4.py [--arch 90] [--gpu "NVIDIA H100 80GB HBM3"] [--rows 1,16] [--out sass_int4.json]

STATIC COUNTS, NOT TIMINGS: instructions, registers and barriers per loop trip, read off the
machine code. They explain a kernel (the 2026-12-06 Nsight Compute profile of the 16-row kernel:
25% occupancy from 128 registers, ~7 instructions issued per weight, ALU the busiest pipe) and
rank changes before a GPU can time them; only a GPU run says what is faster. The launch configs
are the GPU's tuned table (qfd/kernels/tuned/<gpu>.json), else the heuristic. Needs triton
(importable on a CPU box: `pip install triton==3.6.0`), not CUDA.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_int4_kernels import SHAPES  # noqa: E402
from qfd.kernels import int4_configs, int4_layout, int4_triton  # noqa: E402

SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
MEMORY_MOVES = ("STS", "LDS", "LDSM", "BAR")
PREFETCH = False  # --prefetch  # shared-memory traffic and barriers: layout conversions


@dataclass
class LoopStats:
    instructions: int
    opcodes: dict[str, int]  # base opcode (before the first dot) -> count

    def count(self, *names: str) -> int:
        return sum(self.opcodes.get(n, 0) for n in names)


def main_loop_stats(sass: str) -> LoopStats:
    """Instructions of the kernel's main loop: the span of its longest backward branch (the K
    loop; the epilogue's split-K reduction loop is shorter). ValueError when there is no loop."""
    code = [(int(a, 16), op, rest) for a, op, rest in SASS_LINE.findall(sass)]
    loops = []
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    if not loops:
        raise ValueError("no backward branch: the kernel has no loop")
    start, end = max(loops, key=lambda span: span[1] - span[0])
    body = [op.split(".")[0] for addr, op, _ in code if start <= addr <= end]
    return LoopStats(len(body), dict(collections.Counter(body).most_common()))


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


_POINTERS = ("x_ptr", "q_ptr", "s_ptr", "z_ptr", "b_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "pf_ptr")


def compile_kernel(fn, runtime_args: dict[str, str], constants: dict, num_warps: int, num_stages: int, arch: int,
                   values: dict[str, int] | None = None, pointers: tuple[str, ...] = _POINTERS) -> tuple[str, int, int]:
    """(SASS, registers per thread, shared bytes per block) of one specialization of a Triton kernel,
    specialized as a launch would be: `pointers` 16-byte aligned; an integer argument in `values`
    that divides by 16 gets that divisibility, one equal to 1 becomes the constant 1."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    values = values or {}
    ones = {name: 1 for name, v in values.items() if v == 1 and name in runtime_args}
    signature = {name: ("constexpr" if name in ones else kind) for name, kind in runtime_args.items()} | {name: "constexpr" for name in constants}
    aligned = [name for name in runtime_args if name in pointers or (name not in ones and values.get(name, 1) % 16 == 0)]
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in (constants | ones).items()},
                       attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"qfd_sass_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        sass = subprocess.run([str(_tools() / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(_tools() / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    finally:
        cubin.unlink(missing_ok=True)
    # shared memory: Triton's launch size (dynamic: pipeline stages, layout conversions) or the
    # cubin's static allocation, whichever is larger
    shared = max(int(compiled.metadata.shared), int(re.search(r"SHARED:(\d+)", usage).group(1)))
    return sass, int(re.search(r"REG:(\d+)", usage).group(1)), shared


_MM_ARGS = {name: ("*i32" if name in ("q_ptr", "cnt_ptr") else "*fp32" if name == "ws_ptr" else "*bf16") for name in _POINTERS} | {
    name: "i32" for name in ("M", "N", "K", "KT", "stride_xm", "stride_ym")} | {"pf_ptr": "*i32", "pf_lines": "i32"}
_GEMV_ARGS = {name: _MM_ARGS[name] for name in _POINTERS} | {name: "i32" for name in ("N", "K", "KT")} | {"pf_ptr": "*i32", "pf_lines": "i32"}


def kernel_forms(m: int, n: int, k: int, cfg: int4_configs.KernelConfig, group: int = 128):
    """(label, kernel, runtime args, constants, config, weights per thread per loop trip) of the
    forms worth comparing for this row count: `_int4_mm_kernel` (served for one row; for 2+ rows
    the older kernel, QFD_INT4_MMA16=0), for one row `_int4_gemv_two_slot_kernel`
    (QFD_INT4_GEMV=two_slot), and `_int4_mma_kernel` (served for 2+ rows; for one row with 15 of
    16 rows masked, QFD_INT4_MMA16=all)."""
    split = cfg.split_k
    base = dict(GROUP=group, HAS_ZEROS=False, HAS_BIAS=False, SPLIT_K=split, PREFETCH=PREFETCH, PF=32 * cfg.num_warps)
    if cfg.tiles and m == 1:
        yield ("served (gemv)", int4_triton._int4_gemv_kernel, _GEMV_ARGS,
               base | dict(BN=cfg.block_n, TILES=cfg.tiles, OFFSET_SUM=cfg.offset_sum, PDL=False, USE_ASM=True,
                           EVEN_K=k % 128 == 0 and (-(-k // 128)) % cfg.tiles == 0), cfg, 128 * cfg.tiles * cfg.block_n)
    else:
        bm = cfg.block_m if cfg.use_dot else 1
        yield ("old" if cfg.use_dot else "served", int4_triton._int4_mm_kernel, _MM_ARGS,
               base | dict(BM=bm, BN=cfg.block_n, USE_DOT=cfg.use_dot, DOT_IEEE=False, MAGIC_BITS=0, MAGIC=0.0, PDL=False, W_FIRST=False, EVEN_K=k % 128 == 0),
               cfg, 128 * cfg.block_n)
    if m == 1:  # the two-slot gemv with the served outputs per program and split (QFD_INT4_GEMV=two_slot)
        two = int4_configs.as_two_slot(cfg)
        yield ("two-slot gemv", int4_triton._int4_gemv_two_slot_kernel, _GEMV_ARGS,
               base | dict(BN=two.block_n, TILES=two.tiles, USE_ASM=True, EVEN_K=k % 128 == 0 and (-(-k // 128)) % two.tiles == 0,
                           EVEN_N=n % two.block_n == 0), two, 128 * two.tiles * two.block_n)
    dot = cfg if cfg.use_dot else int4_configs.heuristic_config(16, n, k)
    yield ("mma16" if cfg.use_dot else "mma16 (16-row block)", int4_triton._int4_mma_kernel, _MM_ARGS,
           dict(GROUP=group, HAS_ZEROS=False, HAS_BIAS=False, SPLIT_K=dot.split_k, PREFETCH=PREFETCH, PF=32 * dot.num_warps, BM=dot.block_m, BN=dot.block_n, MAGIC_BITS=0x4300, MAGIC=128.0,
                EVEN_M=m % dot.block_m == 0, EVEN_N=n % dot.block_n == 0, EVEN_K=k % 128 == 0, USE_ASM=True),
           replace(dot, mma16=True), 128 * dot.block_n)


def study(rows: list[int], gpu: str, arch: int, shapes=SHAPES) -> list[dict]:
    """One result per (row count, linear, kernel form), with the launch config `pick_config`
    would choose on `gpu` (its tuned table up to 16 rows, else the heuristic)."""
    tuned = int4_configs.tuned_configs(gpu)
    out = []
    for m in rows:
        for name, n, k in shapes:
            cfg = (tuned.get((1 if m == 1 else 16, n, k)) if m <= 16 else None) or int4_configs.heuristic_config(m, n, k)
            values = {"M": m, "N": n, "K": k, "KT": -(-k // int4_layout.TILE_K), "stride_xm": k, "stride_ym": n}
            for label, fn, args, constants, used, weights in kernel_forms(m, n, k, cfg):
                sass, registers, shared = compile_kernel(fn, args, constants, used.num_warps, used.num_stages, arch, values)
                loop = main_loop_stats(sass)
                per_thread = weights / (32 * used.num_warps)
                out.append({"rows": m, "linear": name, "n": n, "k": k, "form": label, "config": {key: v for key, v in vars(used).items() if v is not None},
                            "registers": registers, "shared_bytes": shared, "loop_instructions": loop.instructions,
                            "instructions_per_weight": loop.instructions / per_thread, "barriers_per_trip": loop.count("BAR"),
                            "shared_moves_per_trip": loop.count(*MEMORY_MOVES[:3]), "mma_per_trip": loop.count("HMMA", "HGMMA"), "opcodes": loop.opcodes})
    return out


def report(results: list[dict], gpu: str, arch: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"INT4 kernels' main loop, STATIC SASS counts (sm_{arch}, configs of {gpu}'s tuned table): not timings")
    for col in ("rows", "linear", "form", "BN x warps x stages", "registers", "instr / weight", "barriers / trip", "smem moves / trip", "top opcodes"):
        table.add_column(col, justify="left" if col in ("linear", "form", "top opcodes") else "right")
    for r in results:
        c = r["config"]
        top = ", ".join(f"{op} {count}" for op, count in list(r["opcodes"].items())[:6])
        table.add_row(str(r["rows"]), r["linear"], r["form"], f"{c['block_n']} x {c['num_warps']} x {c['num_stages']}", str(r["registers"]),
                      f"{r['instructions_per_weight']:.2f}", str(r["barriers_per_trip"]), str(r["shared_moves_per_trip"]), top)
    Console().print(table)


def main() -> None:
    p = argparse.ArgumentParser(description="Static SASS counts of the INT4 kernels (no GPU): instructions per weight, registers, barriers")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 to compile for (default 90: H100/H200)")
    p.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", help="whose tuned table gives the launch configs (default the H100's)")
    p.add_argument("--rows", default="1,16", help="comma-separated row counts (1: decode, 16: verify)")
    p.add_argument("--shapes", default="fused", help="'fused' (the fused target + drafter shapes), 'all', or comma-separated linear names")
    p.add_argument("--prefetch", action="store_true", help="compile the kernels with their L2 prefetch of the next product's weights (QFD_INT4_PREFETCH)")
    p.add_argument("--out", type=Path, default=Path("sass_int4.json"))
    args = p.parse_args()
    global PREFETCH
    PREFETCH = args.prefetch
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("sass_int4.py needs triton (pip install triton==3.6.0); no GPU is needed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("sass_int4.py compiles the kernels: unset TRITON_INTERPRET (the interpreter has no machine code)")
    if args.shapes == "all":
        shapes = SHAPES
    elif args.shapes == "fused":
        shapes = tuple(s for s in SHAPES if s[0].startswith(("fused", "drafter")))
    else:
        wanted = {name.strip() for name in args.shapes.split(",")}
        shapes = tuple(s for s in SHAPES if s[0] in wanted)
        if not shapes:
            sys.exit(f"--shapes: none of {sorted(wanted)} is a known linear ({', '.join(s[0] for s in SHAPES)})")
    rows = [int(r) for r in args.rows.split(",") if r]
    results = study(rows, args.gpu, args.arch, shapes)
    args.out.write_text(json.dumps({"arch": args.arch, "gpu_table": args.gpu, "note": "static SASS counts, not timings", "rows": results}, indent=2))
    report(results, args.gpu, args.arch)


if __name__ == "__main__":
    main()
