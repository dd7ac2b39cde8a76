"""`qfd eval` on the command line: user mistakes are one red line (exit 2) before any model
loads; a quality run on a tiny model writes results, samples and a manifest with both gates;
an interrupted run resumes from its finished tasks; the engine path on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"


def _fails(argv, capsys, match):
    from qfd.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_user_mistakes_fail_fast(tmp_path, capsys, tiny_checkpoints):
    target = str(tiny_checkpoints["llama"])
    _fails(["eval", "mmlu", "--target", target], capsys, "unknown eval task")
    _fails(["eval", "gpqa", "--target", str(tmp_path / "nope")], capsys, "does not exist")
    _fails(["eval", "gpqa", "--target", target, "--data-dir", str(tmp_path)], capsys, "gpqa_diamond.jsonl")
    _fails(["eval", "latency", "--target", target, "--lengths", "short=64"], capsys, "NAME=IN/OUT")
    _fails(["eval", "ifeval", "--target", target, "--drafter", str(tmp_path)], capsys, "not a drafter directory")
    _fails(["eval", "ifeval", "--target", target, "--limit", "0"], capsys, "--limit")


def test_quality_run_writes_results_samples_and_manifest(tiny_chat_checkpoints, tmp_path, capsys):
    from qfd.cli import main
    from qfd.manifest import read_manifest

    target = str(tiny_chat_checkpoints["llama"])
    baseline = str(tiny_chat_checkpoints["qwen3"])
    out = tmp_path / "ev"
    # mmlu-pro's lm-eval path is covered by test_harness (its 14 subjects x 5 shots are slow here).
    argv = ["eval", "ifeval", "gpqa", "--target", target, "--baseline", baseline, "--data-dir", str(DATA),
            "--limit", "1", "--max-gen-toks", "3", "--out", str(out), "--device", "cpu", "--batch-size", "4", "--backend", "hf"]
    main(argv)
    printed = capsys.readouterr().out
    assert "paper gate" in printed and ">= 95%" in printed
    results = json.loads((out / "results.json").read_text())
    assert set(results["quality"]) == {"ifeval", "gpqa"}
    gpqa = results["quality"]["gpqa"]
    assert gpqa["paper_gate"] == 0.630 and gpqa["system"]["metric"] == "exact_match,flexible-extract"
    assert {"baseline", "passes_relative_gate", "passes_paper_gate"} <= set(gpqa)
    assert results["quality"]["ifeval"]["system"]["n"] == 1
    # Outputs are at most 3 new tokens: the cap reached every task.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    rows = [json.loads(line) for line in (out / "samples-system-gpqa.jsonl").read_text().splitlines()]
    assert rows and all(len(tok(r["response"], add_special_tokens=False)["input_ids"]) <= 4 for r in rows)
    manifest = read_manifest(out)
    assert manifest["stage"] == "eval"
    assert {p["role"] for p in manifest["parents"]} == {"target", "baseline"}
    assert set(manifest["metrics"]) >= {"ifeval", "gpqa", "ifeval_baseline"}
    _fails(argv, capsys, "--overwrite")


def test_an_interrupted_run_resumes_from_finished_tasks(tiny_chat_checkpoints, tmp_path, monkeypatch):
    """A task whose result is already in the staging state is not evaluated again."""
    import qfd.stages.eval as stage

    target = str(tiny_chat_checkpoints["llama"])
    out = tmp_path / "ev"
    cfg = stage.EvalConfig(tasks=("ifeval", "gpqa"), target=target, out=out, data_dir=DATA, limit=1, max_gen_toks=2, device="cpu", backend="hf")
    calls = []
    real = stage.evaluate_quiet

    def crash_on_gpqa(lm, task, include_dir, limit):
        calls.append(task)
        if task == "gpqa" and calls.count("gpqa") == 1:
            raise KeyboardInterrupt  # killed mid-run
        return real(lm, task, include_dir, limit)

    monkeypatch.setattr(stage, "evaluate_quiet", crash_on_gpqa)
    with pytest.raises(KeyboardInterrupt):
        stage.run(cfg)
    assert not out.exists() and (out.parent / "ev.partial").is_dir()
    stage.run(cfg)
    assert calls == ["ifeval", "gpqa", "gpqa"]
    assert set(json.loads((out / "results.json").read_text())["quality"]) == {"ifeval", "gpqa"}


@pytest.mark.slow
def test_engine_path_on_the_embedded_model(tmp_path):
    """The served path (qfd's engine) drives lm-eval; skipped until the engine is in the build."""
    from qfd.stages.eval import engine_available

    if not engine_available():
        pytest.skip("qfd.engine / qfd.models.loading not in this build yet")
    from qfd.cli import main

    out = tmp_path / "ev"
    main(["eval", "ifeval", "--target", "smollm2-135m", "--data-dir", str(DATA), "--limit", "2", "--max-gen-toks", "8",
          "--out", str(out), "--device", "cpu", "--backend", "engine"])
    results = json.loads((out / "results.json").read_text())
    assert results["backend"] == "engine"
    ifeval = results["quality"]["ifeval"]["system"]
    assert ifeval["n"] == 2 and 0.0 <= ifeval["score"] <= 1.0 and ifeval["engine"]["requests"] == 2
