"""Does every Triton kernel qfd launches build for a given GPU architecture? Checked without a GPU:

    python bench/compile_kernels.py record --out launches.json [pytest args]   # default: the kernel tests
    python bench/compile_kernels.py compile --launches launches.json [--arch 80,86,89,90] [--out compiled.json]

`record` runs tests under Triton's CPU interpreter (TRITON_INTERPRET=1) and writes down each
kernel launch as the launch code made it: the kernel, its arguments' types (a tensor's dtype and
16-byte alignment, a scalar's type and value), the constexpr values, num_warps and num_stages.
`compile` builds each distinct specialization with Triton's own compiler and ptxas for each
architecture - sm_86 is the A10G the paper serves on, sm_80 the A100, sm_89 the L4, sm_90 the
H100/H200 - and reports registers and shared memory per block against the architecture's limit.

A BUILD CHECK, NOT A RUN: it says the kernels compile and fit, not that they are correct or fast
there (the interpreter tests say correct; only that GPU says fast). The launches are those the
recorded tests make, at their (small) shapes; the kernels' constexpr choices that depend on the
shape are covered as far as those tests vary them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["tests/test_int4_triton.py", "tests/test_int4_dequant.py", "tests/test_gdn_kernel.py", "tests/test_attention_triton.py",
                "tests/test_attention_inputs_triton.py", "tests/test_norm_triton.py", "tests/test_int8_head.py", "tests/test_int4_head.py"]
# opt-in shared memory per block (bytes) by compute capability
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_TORCH_TO_TRITON = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64", "torch.int32": "i32",
                    "torch.int64": "i64", "torch.int16": "i16", "torch.int8": "i8", "torch.uint8": "u8", "torch.bool": "i1"}


def describe(value) -> dict:
    """One launch argument as the compiler needs it: a tensor's element type and alignment, or a scalar."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"kind": "tensor", "dtype": _TORCH_TO_TRITON[str(value.dtype)], "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "scalar", "value": value}
    if hasattr(value, "value"):  # a tl.constexpr passed through
        return {"kind": "scalar", "value": value.value}
    return {"kind": "scalar", "value": repr(value)}


def record(out: Path, pytest_args: list[str]) -> int:
    """Run pytest under the interpreter with every kernel launch written down (distinct ones)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
        entry = {"module": self.fn.__module__, "kernel": self.fn.__name__, "options": options,
                 "args": {name: describe(value) for name, value in bound.items()}}
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    code = pytest.main(["-q", "-p", "no:cacheprovider", *(pytest_args or KERNEL_TESTS)])
    launches = [e for e in seen.values() if e["module"].startswith("qfd.")]
    out.write_text(json.dumps({"launches": launches}, indent=1))
    print(f"{len(launches)} distinct qfd kernel launches from {len({(e['module'], e['kernel']) for e in launches})} kernels -> {out}")
    return int(code)


def specialization(fn, entry: dict):
    """(ASTSource, options, a key equal for launches that build the same code) for one recorded
    launch of JITFunction `fn`."""
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        arg = entry["args"].get(param.name)
        if arg is None:  # not passed: the parameter's default
            constexprs[(index,)] = param.default if param.has_default else None
            signature[param.name] = "constexpr"
            continue
        if param.is_constexpr or (arg["kind"] == "scalar" and arg["value"] is None):
            signature[param.name] = "constexpr"
            constexprs[(index,)] = arg["value"]
        elif arg["kind"] == "tensor":
            signature[param.name] = "*" + arg["dtype"]
            if arg["aligned"]:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            value = arg["value"]
            if isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0 and value != 0 and not param.do_not_specialize:
                    attrs[(index,)] = [["tt.divisibility", 16]]
            else:
                signature[param.name] = "fp32"
    options = {"num_warps": entry["options"].get("num_warps", 4), "num_stages": entry["options"].get("num_stages", 3)}
    key = repr((entry["module"], entry["kernel"], sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items()), sorted(options.items())))
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options, key


def constexpr_values(fn, entry: dict) -> dict:
    """The launch's constexpr arguments by name (what tells one specialization from another)."""
    return {p.name: entry["args"][p.name]["value"] for p in fn.params if p.is_constexpr and p.name in entry["args"]}


def compile_all(launches: list[dict], archs: list[int]) -> list[dict]:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from rich.progress import track

    builds, results = {}, []
    for entry in launches:  # launches that differ only in non-constexpr scalar values build the same code
        fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        source, options, key = specialization(fn, entry)
        builds.setdefault(key, (entry, source, options, constexpr_values(fn, entry)))
    for entry, source, options, constexprs in track(list(builds.values()), description=f"building {len(builds)} specializations x {len(archs)} archs"):
        for arch in archs:
            row = {"module": entry["module"], "kernel": entry["kernel"], "arch": arch, "options": options, "constexprs": constexprs}
            try:
                compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
                row |= {"ok": True, "shared": int(compiled.metadata.shared), "registers": _registers(compiled)}
                row["fits"] = row["shared"] <= SHARED_LIMIT.get(arch, 99 * 1024)
            except Exception as exc:  # a build failure is the finding: keep its first line
                row |= {"ok": False, "fits": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"}
            results.append(row)
    return results


def _registers(compiled) -> int | None:
    import re
    import subprocess
    import tempfile

    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", cubin.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+)", usage)
    return int(match.group(1)) if match else None


def report(results: list[dict], archs: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Triton kernels built per architecture (a BUILD check from recorded launches, not a run)")
    table.add_column("kernel", justify="left", no_wrap=True)
    table.add_column("specializations", justify="right")
    for arch in archs:
        table.add_column(f"sm_{arch} built / fits", justify="right")
    table.add_column("max registers", justify="right")
    table.add_column("max shared KB", justify="right")
    kernels = sorted({(r["module"], r["kernel"]) for r in results})
    for module, kernel in kernels:
        rows = [r for r in results if (r["module"], r["kernel"]) == (module, kernel)]
        cells = []
        for arch in archs:
            mine = [r for r in rows if r["arch"] == arch]
            cells.append(f"{sum(r['ok'] for r in mine)}/{sum(r['fits'] for r in mine)} of {len(mine)}")
        built = [r for r in rows if r["ok"]]
        table.add_row(f"{module.rsplit('.', 1)[-1]}.{kernel}", str(len(rows) // len(archs)), *cells,
                      str(max((r["registers"] or 0) for r in built)) if built else "-", f"{max(r['shared'] for r in built) / 1024:.1f}" if built else "-")
    Console().print(table)
    for r in results:
        if not r["ok"]:
            print(f"FAILED {r['kernel']} sm_{r['arch']}: {r['error']}")
        elif not r["fits"]:
            print(f"TOO MUCH SHARED MEMORY {r['kernel']} sm_{r['arch']}: {r['shared'] / 1024:.1f} KB > {SHARED_LIMIT.get(r['arch'], 99 * 1024) / 1024:.0f} KB; "
                  f"{r['options']} {r['constexprs']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run tests under the interpreter, writing down every kernel launch")
    rec.add_argument("--out", type=Path, default=Path("kernel_launches.json"))
    rec.add_argument("pytest_args", nargs=argparse.REMAINDER, help="pytest arguments (default: the kernel tests)")
    com = sub.add_parser("compile", help="build each recorded launch for each architecture")
    com.add_argument("--launches", type=Path, default=Path("kernel_launches.json"))
    com.add_argument("--arch", default="80,86,89,90", help="comma-separated compute capabilities x10")
    com.add_argument("--kernels", default="", help="comma-separated kernel names: build only these")
    com.add_argument("--out", type=Path, default=Path("compiled_kernels.json"))
    args = p.parse_args()
    if args.command == "record":
        return record(args.out, [a for a in args.pytest_args if a != "--"])
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile_kernels.py compile: unset TRITON_INTERPRET (it builds the real kernels)")
    sys.path.insert(0, str(ROOT))
    archs = [int(a) for a in args.arch.split(",")]
    launches = json.loads(args.launches.read_text())["launches"]
    wanted = {k for k in args.kernels.split(",") if k}
    launches = [e for e in launches if not wanted or e["kernel"] in wanted]
    results = compile_all(launches, archs)
    args.out.write_text(json.dumps({"archs": archs, "note": "a build check from recorded launches, not a run", "results": results}, indent=1))
    report(results, archs)
    return 0 if all(r["ok"] and r["fits"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
