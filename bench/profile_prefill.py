"""Where a long prompt's eager prefill spends its time: kernel profile of one prefill at
Qwen3.5-4B shape (random weights: exact costs), bf16 and INT4, with the wall time beside the
summed kernel time (their gap is launch overhead: the GPU waiting on Python).

    python bench/profile_prefill.py [--tokens 8192] [--int4] [--gdn qfd,fla,fla_conv] [--out prefill_profile.json]

--gdn: the long-prompt Gated DeltaNet forms to profile side by side (qfd.kernels.gdn_fla: "fla"
- the package's chunk rule after qfd's torch conv and gates - and "fla_conv" - its conv too -
need flash-linear-attention installed; "qfd" is qfd's own chunked form).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qfd.kernels import gdn_fla  # noqa: E402
from bench_steps import QWEN35_4B, build_target, gdn_prefill_backend, kernel_profile, timer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--int4", action="store_true", help="also the INT4 (RTN g128, Triton kernel) target")
    p.add_argument("--gdn", default="qfd,fla,fla_conv", help="comma-separated long-prompt GDN forms: qfd, fla, fla_conv (default all three; fla* skipped where not installed)")
    p.add_argument("--out", type=Path, default=Path("prefill_profile.json"))
    args = p.parse_args()
    device = torch.device("cuda")
    from rich.console import Console
    from rich.table import Table

    results = {"device": torch.cuda.get_device_name(), "tokens": args.tokens}
    for precision in ["bf16"] + ["int4"] * args.int4:
        model = build_target(QWEN35_4B, device, torch.bfloat16, int4=precision == "int4", group_size=128, kernel="triton")
        cache = model.new_cache(args.tokens + 64, static=True)
        prompt = torch.randint(0, 200000, (1, args.tokens), device=device)

        def prefill():
            cache.reset()
            with torch.inference_mode():
                model(prompt, cache, last_only=True)

        for gdn in args.gdn.split(","):
            if gdn.startswith("fla") and not gdn_fla.installed():
                print("flash-linear-attention is not installed here: no fla row")
                continue
            with gdn_prefill_backend(gdn):
                wall = timer(device)(prefill, iters=3, warmup=1)
                prof = kernel_profile(prefill, device, iters=2, top=20)
            results[f"{precision}_{gdn}"] = {"wall_ms": wall, **prof}
            t = Table(title=f"{precision} prefill of {args.tokens} tokens, GDN: {gdn}, {results['device']}: {wall:.1f} ms wall, {prof['kernel_us_per_step'] / 1e3:.1f} ms of kernels in {prof['kernels_per_step']:.0f} launches")
            for col in ("kernel", "ms", "calls"):
                t.add_column(col, justify="left" if col == "kernel" else "right")
            for r in prof["top"]:
                t.add_row(r["name"][:100], f"{r['us_per_step'] / 1e3:.2f}", f"{r['calls_per_step']:.0f}")
            Console(width=160).print(t)
            args.out.write_text(json.dumps(results, indent=2))
        del model, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
