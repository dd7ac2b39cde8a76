"""A target for NVIDIA Nsight Compute: one 16-row and one 1-row INT4 product at the fused MLP
gate/up shape (18432 x 2560, group 128), each launched three times (compile, then two clean
launches), with the launch config printed. Answers whether the 16-row kernel is bound by memory or
by instruction issue (docs/benchmarks.md, 2026-12-06 fifteenth session: latency-bound at 25%
occupancy, ~7 instructions per weight - the kernel served then, `_int4_mm_kernel`). For 2+ rows
the served kernel is now `_int4_mma_kernel`; `--forms served,old` profiles the older one beside
it, `--forms served,mma16` the new one for one row too (as a 16-row tensor-core block).

    ncu -k regex:_int4 --section SpeedOfLight --section InstructionStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section Occupancy python3 bench/profile_int4_ncu.py [--n 18432 --k 2560]

Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qfd.kernels import int4_configs, int4_layout, int4_triton  # noqa: E402
from qfd.quant.grid import rtn_quantize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=18432)
    p.add_argument("--k", type=int, default=2560)
    p.add_argument("--rows", default="16,1", help="comma-separated row counts, profiled in this order")
    p.add_argument("--gated", action="store_true", help="after each plain product, the same product as a GATED one (silu(gate) * up stored by the kernel, an MLP's gate/up pair): the kernel names are the same, so ncu lists plain then gated per form")
    p.add_argument("--forms", default="served", help="comma-separated: served (the config Int4Linear picks), mma16 (_int4_mma_kernel), old (_int4_mm_kernel, QFD_INT4_MMA16=0)")
    args = p.parse_args()
    if not (torch.cuda.is_available() and int4_triton.available()):
        sys.exit("profile_int4_ncu.py needs CUDA and Triton")
    torch.manual_seed(0)
    qw = rtn_quantize(torch.randn(args.n, args.k, device="cuda") * 0.02, 128, scale_dtype=torch.bfloat16)
    packed = int4_layout.pack_for_triton(qw, "cuda", scale_dtype=torch.bfloat16)
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16)
        served = int4_configs.pick_config(m, args.n, args.k, x.device)
        for form in args.forms.split(","):
            if form == "served":
                cfg = served
            elif form == "mma16":
                cfg = replace(served if served.use_dot else int4_configs.heuristic_config(16, args.n, args.k), mma16=True)
            elif form == "old":
                cfg = replace(served, mma16=False)
            else:
                sys.exit(f"--forms: unknown form {form!r} (served, mma16, old)")
            for gated in (False, True) if args.gated else (False,):
                for _ in range(3):
                    int4_triton.int4_matmul(x, packed, config=cfg, gated=gated)
                torch.cuda.synchronize()
                print(f"rows={m} {form}{' gated' if gated else ''}: {cfg}")


if __name__ == "__main__":
    main()
