"""bench/bench_qad_memory.py runs on CPU with a tiny Qwen3.5 shape."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def test_bench_qad_memory_tiny_cpu(tmp_path):
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_qad_memory.py"
    spec = importlib.util.spec_from_file_location("bench_qad_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--shape", "tiny", "--device", "cpu", "--steps", "2", "--seq-len", "32", "--group-size", "32", "--state-dir", str(tmp_path / "s"), "--json", str(tmp_path / "r.json")])
    assert (tmp_path / "r.json").is_file()
    assert result["tokens_per_s"] > 0 and len(result["kl"]) == 2
    assert all(k >= 0 for k in result["kl"]) and 0 < result["latent_params"] < result["params"]
    assert result["kl"][0] > 0 or pytest.fail("INT4 student should differ from its teacher")
