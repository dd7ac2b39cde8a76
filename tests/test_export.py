"""`qfd export vllm`: files and tensor names as vLLM's DFlash and compressed-tensors loaders expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qfd.cli import main
from qfd.vllm_layout import drafter_problems, target_problems


def _cli(args: list[str]) -> int:
    try:
        main(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.fixture(scope="module")
def int4_target(tiny_chat_checkpoints, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "int4"
    assert _cli(["quantize", "--model", str(tiny_chat_checkpoints["llama"]), "--method", "rtn", "--group-size", "32", "--format", "gptq", "--out", str(out)]) == 0
    return out


def _drafter(target: Path, out: Path, sliding_window=None) -> Path:
    import torch

    from qfd.checkpoint import read_json
    from qfd.manifest import write_manifest
    from qfd.models.drafter import DFlashDrafter, config_for_target
    from qfd.models.drafter_io import save_drafter

    torch.manual_seed(0)
    cfg = config_for_target(read_json(target / "config.json"), num_layers=2, taps=(1, 2), sliding_window=sliding_window)
    save_drafter(DFlashDrafter(cfg), out)
    write_manifest(out, stage="draft-stage2", parents={"target": target})
    return out


def test_export_converts_target_and_checks_names(int4_target, tmp_path):
    drafter = _drafter(int4_target, tmp_path / "drafter", sliding_window=64)
    out = tmp_path / "export"
    assert _cli(["export", "vllm", "--target", str(int4_target), "--drafter", str(drafter), "--out", str(out)]) == 0
    target_config = json.loads((out / "target" / "config.json").read_text())
    assert target_config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert target_problems(out / "target") == []
    assert drafter_problems(out / "drafter") == []
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == {"method": "dflash", "model": "./drafter", "num_speculative_tokens": 15}
    assert "vllm serve ./target --speculative-config" in (out / "serve.sh").read_text()
    drafter_config = json.loads((out / "drafter" / "config.json").read_text())
    assert drafter_config["sliding_window"] == 64 and set(drafter_config["layer_types"]) == {"sliding_attention"}
    assert drafter_config["dflash_config"]["causal"] is False


def test_converted_target_dequantizes_identically(int4_target, tmp_path):
    import torch

    from qfd.quant.formats import load_quantized

    drafter = _drafter(int4_target, tmp_path / "drafter")
    out = tmp_path / "export"
    assert _cli(["export", "vllm", "--target", str(int4_target), "--drafter", str(drafter), "--out", str(out)]) == 0
    source, converted = load_quantized(int4_target), load_quantized(out / "target")
    assert set(source.qweights) == set(converted.qweights)
    from qfd.quant.grid import dequantize

    for name, qw in source.qweights.items():
        assert torch.equal(dequantize(qw), dequantize(converted.qweights[name])), name


def test_layout_checks_catch_wrong_names(int4_target, tmp_path):
    from safetensors.torch import load_file, save_file

    drafter = _drafter(int4_target, tmp_path / "drafter")
    state = load_file(str(drafter / "model.safetensors"))
    state["layers.0.self_attn.qkv.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    save_file(state, str(drafter / "model.safetensors"))
    problems = drafter_problems(drafter)
    assert any("missing" in p and "q_proj" in p for p in problems)
    assert any("unexpected" in p for p in problems)
    assert _cli(["export", "vllm", "--target", str(int4_target), "--drafter", str(drafter), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_export_refuses_foreign_target(int4_target, tiny_chat_checkpoints, tmp_path):
    drafter = _drafter(int4_target, tmp_path / "drafter")
    # same shapes, other weights: the pinned fingerprint does not match
    assert _cli(["export", "vllm", "--target", str(tiny_chat_checkpoints["llama"]), "--drafter", str(drafter), "--out", str(tmp_path / "x")]) == 2


def _serve_vllm(args, path_dir, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": f"{path_dir}:{os.defpath}", "HOME": str(tmp_path / "home")}
    return subprocess.run([sys.executable, "-m", "qfd", "serve", "--engine", "vllm", *args], capture_output=True, text=True, env=env, timeout=300)


def test_serve_engine_vllm_says_clearly_when_vllm_is_missing(int4_target, tmp_path):
    (tmp_path / "empty").mkdir()
    done = _serve_vllm(["--target", str(int4_target)], tmp_path / "empty", tmp_path)
    assert done.returncode == 2
    assert "vLLM is not installed" in done.stderr and "Traceback" not in done.stderr


def test_serve_engine_vllm_exports_then_execs_vllm_serve(int4_target, tmp_path):
    """A stand-in `vllm` executable records the command qfd hands over to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    fake = bin_dir / "vllm"
    fake.write_text(f"#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    drafter = _drafter(int4_target, tmp_path / "drafter", sliding_window=64)
    export = tmp_path / "export"
    done = _serve_vllm(["--target", str(int4_target), "--drafter", str(drafter), "--port", "8123", "--api-key", "k1", "--export-dir", str(export)], bin_dir, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    argv = json.loads(record.read_text())
    assert argv[:2] == ["serve", str(export / "target")]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--api-key") + 1] == "k1"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(export / "drafter"), "num_speculative_tokens": 15}
    assert target_problems(export / "target") == [] and drafter_problems(export / "drafter") == []
