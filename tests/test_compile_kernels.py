"""bench/compile_kernels.py: launches recorded under the interpreter build for Ampere, Ada and
Hopper (needs triton; skipped without it, as on CI)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

needs_triton_compiler = pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                                           reason="building needs triton (not on CI), and not its interpreter")


def _record(tmp_path: Path, *tests: str) -> list[dict]:
    out = tmp_path / "launches.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/compile_kernels.py"), "record", "--out", str(out), *tests],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())["launches"]


@needs_triton_compiler
def test_the_norm_kernels_recorded_launches_build_for_the_a10g_and_the_h100(tmp_path):
    from compile_kernels import compile_all

    launches = _record(tmp_path, "tests/test_norm_triton.py")
    assert len(launches) > 1 and {e["module"] for e in launches} == {"qfd.kernels.norm_triton"}
    results = compile_all(launches, [86, 90])
    assert results and all(r["ok"] and r["fits"] for r in results), [r for r in results if not (r["ok"] and r["fits"])]
    assert {r["arch"] for r in results} == {86, 90}


@needs_triton_compiler
def test_a_launch_that_cannot_build_is_reported_not_raised(tmp_path):
    """The check can fail: a block size that is not a power of two (tl.arange refuses it)."""
    from compile_kernels import compile_all

    launch = _record(tmp_path, "tests/test_norm_triton.py")[0]
    assert "BD" in launch["args"]
    launch["args"]["BD"] = {"kind": "scalar", "value": 100}
    (result,) = compile_all([launch], [86])
    assert not result["ok"] and not result["fits"] and result["error"]


@needs_triton_compiler
def test_float32_attention_and_int8_head_launches_fit_an_a10g(tmp_path):
    """The largest float32 tiles the launchers pick - a 256-wide attention head at 64 rows a block,
    the INT8 head at 32 rows - within the 99 KB of shared memory per block of an A10G / L4. At the
    H100-tuned configs they took 136 and 105 KB: they built, but could not launch there."""
    from compile_kernels import compile_all

    launches = _record(tmp_path, "tests/test_attention_triton.py::test_kernel_matches_the_reference[1-16-4-32-200-256-tree]",
                       "tests/test_int8_head.py::test_kernel_matches_the_reference[128-32]")
    assert {e["kernel"] for e in launches} >= {"_split_kernel", "_int8_matmul_kernel"}
    assert any(e["args"]["D"]["value"] == 256 and e["args"]["BR"]["value"] == 64 for e in launches if e["kernel"] == "_split_kernel")
    results = compile_all(launches, [86, 89])
    assert all(r["ok"] and r["fits"] for r in results), [(r["kernel"], r["arch"], r.get("shared"), r["constexprs"]) for r in results if not r["fits"]]
