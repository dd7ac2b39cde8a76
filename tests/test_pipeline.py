"""`qfd all` end to end on the real embedded model (the `quick` preset: every stage, least work).

One run is killed with SIGKILL in the middle of a stage; the re-run must skip what finished
(verified by manifest), never take the half-written stage for complete, resume, and finish every
stage with a checkpoint whose files match its manifest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from qfd.manifest import is_complete, read_manifest
from qfd.presets import PRESETS, steps_for
from qfd.stages.all import Paths


def _pipeline(out):
    return [sys.executable, "-m", "qfd", "all", "--preset", "quick", "--out", str(out), "--device", "cpu"]


def _kill_when_started(cmd, partial, env, limit_s=900):
    """Start `cmd`, SIGKILL its whole process group once `partial` exists (a stage is mid-way)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + limit_s
    try:
        while not partial.exists():
            if proc.poll() is not None:
                pytest.fail(f"qfd all ended (code {proc.returncode}) before {partial.name} appeared:\n{proc.stdout.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{partial.name} did not appear within {limit_s} s")
            time.sleep(0.1)
        time.sleep(1.0)  # let the stage get some way in
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


@pytest.mark.slow
def test_qfd_all_is_killed_mid_stage_and_resumes_to_the_end(tmp_path, embedded_model_dir, gsm8k_dir):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    _kill_when_started(_pipeline(out), out / "2-qad.partial", env)

    assert is_complete(out / "1-quantize", stage="quantize", deep=True)
    first_quantize = read_manifest(out / "1-quantize")
    assert not (out / "2-qad").exists(), "a killed stage must not leave a finished-looking directory"
    assert not is_complete(out / "2-qad.partial")

    done = subprocess.run(_pipeline(out), capture_output=True, text=True, env=env, timeout=1500)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    assert "done" in done.stderr and "quantize" in done.stderr
    assert read_manifest(out / "1-quantize") == first_quantize, "the finished stage was re-run"

    steps = steps_for(PRESETS["quick"])
    paths = Paths(root=out, model="smollm2-135m", ckpt=None, device="cpu")
    for step in steps:
        assert step.enabled(paths)
        assert is_complete(out / step.subdir, stage=step.manifest_stage, deep=True), step.name
        assert not (out / (step.subdir + ".partial")).exists()
        assert step.name in done.stdout  # the summary table has a row per stage

    # The pieces are wired to each other, not merely present.
    parents = lambda sub: {p["role"]: p["path"] for p in read_manifest(out / sub)["parents"]}  # noqa: E731
    assert parents("6-draft-stage2")["init"] == str(out / "4-draft-stage1")
    assert parents("6-draft-stage2")["target"] == str(out / "2-qad")
    qad = read_manifest(out / "2-qad")["metrics"]
    # 40 small steps: measured -17.5% held-out KL here (the demo preset: -42%)
    assert qad["sanity_passed"] and qad["kl_after"] < 0.9 * qad["kl_before"], qad
    _loads_in_transformers_like_the_runtime(out / "2-qad")  # SmolLM2: a tied head
    latency = read_manifest(out / "9-eval-latency")["metrics"]
    assert latency, "eval latency recorded no metrics"
    chosen = json.loads((out / "9-eval-latency" / "results.json").read_text())["draft_len"]  # the preset's --draft-len auto
    assert chosen and all(1 <= k <= 15 for k in chosen.values()), chosen
    quality = json.dumps(read_manifest(out / "10-eval-quality")["metrics"])
    assert "ifeval" in quality


def _loads_in_transformers_like_the_runtime(int4_dir):
    """transformers' compressed-tensors path decompresses the checkpoint to the logits of qfd's
    INT4 runtime (a tied LM head must be listed as not quantized for it to load at all)."""
    import torch
    from transformers import AutoModelForCausalLM

    from qfd.models.loading import load_target

    hf = AutoModelForCausalLM.from_pretrained(int4_dir, dtype=torch.float32).eval()
    runtime, tokenizer = load_target(int4_dir, "cpu", torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf(ids).logits
        got = runtime(ids, runtime.new_cache(32)).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-4)
