"""The latency protocol: exact-length prose prompts, warm-ups untimed, medians, speedups, plots,
and `qfd eval latency` end to end on a tiny model (JSON + both PNGs + manifest)."""

from __future__ import annotations

import json

import pytest

from qfd.errors import QfdError
from qfd.latency import (
    RunResult,
    add_speedups,
    build_prompts,
    build_settings,
    measure,
    parse_lengths,
    plot_acceptance,
    plot_latency,
    prose_prompt,
    read_questions,
)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)


def test_lengths_default_to_the_protocol_and_scale_down():
    lengths = parse_lengths(None)
    assert lengths == {"short": (64, 128), "medium": (2048, 256), "long": (8192, 256)}
    custom = parse_lengths("short=8/4,tiny=2/3")
    assert custom["short"] == (8, 4) and custom["tiny"] == (2, 3) and custom["long"] == (8192, 256)
    settings = build_settings(["long", "short"], lengths, scale=0.01)
    assert [(s.name, s.input_len, s.output_len) for s in settings] == [("long", 82, 3), ("short", 1, 1)]
    with pytest.raises(QfdError, match="NAME=IN/OUT"):
        parse_lengths("short=64")
    with pytest.raises(QfdError, match="unknown latency setting"):
        build_settings(["huge"], lengths)


def test_prompts_are_exact_length_real_prose_and_differ(tokenizer, gsm8k_dir):
    questions = read_questions(gsm8k_dir / "test.jsonl")
    for length in (1, 64, 700):
        ids = prose_prompt(questions, tokenizer, length, offset=3)
        assert len(ids) == length
    prompts = build_prompts(questions, tokenizer, 256, count=4)
    assert len({tuple(p) for p in prompts}) == 4
    # Prose, not filler: many distinct tokens, and the text is GSM8K's own.
    assert len(set(prompts[0])) > 100
    assert tokenizer.decode(prompts[0][:20]) in "\n\n".join(questions[:10])


def test_measure_times_only_the_runs_after_warmup():
    seen = []

    def fake(prompt, new_tokens):
        seen.append(prompt[0])
        # Warm-ups (prompts 0-1) are slow, as first calls are; timed runs take 1..5 s.
        seconds = 100.0 if prompt[0] < 2 else float(prompt[0] - 1)
        return RunResult(seconds, new_tokens, tau=2.0 + prompt[0], accept_per_position=(0.9, 0.5))

    summary = measure(fake, [[i] for i in range(7)], output_len=10, warmup=2, runs=5)
    assert seen == list(range(7))
    assert summary["median_s"] == 3.0 and summary["runs_s"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert summary["tokens_per_s"] == pytest.approx(10 / 3.0)
    assert summary["tau"] == pytest.approx(2.0 + 4.0)  # mean over the timed runs 2..6
    assert summary["accept_per_position"] == [0.9, 0.5]
    assert summary["exact_output_len"]


def _report():
    report = {"labels": {"system": "target + drafter", "baseline": "bf16"}, "settings": {}}
    for name, base, sys_s in (("short", 2.0, 1.0), ("medium", 3.0, 1.5), ("long", 4.0, 4.0)):
        report["settings"][name] = {
            "input_len": 4, "output_len": 2,
            "baseline": {"median_s": base},
            "system": {"median_s": sys_s, "tau": 3.0, "accept_per_position": [0.8, 0.6, 0.3]},
        }
    return report


def test_speedups_per_setting_and_their_mean():
    report = add_speedups(_report())
    assert [e["speedup"] for e in report["settings"].values()] == [2.0, 2.0, 1.0]
    assert report["mean_speedup"] == pytest.approx(5 / 3)
    assert report["mean_tau"] == 3.0


def test_plots_are_pngs(tmp_path):
    report = add_speedups(_report())
    for plot, name in ((plot_latency, "latency.png"), (plot_acceptance, "acceptance.png")):
        path = plot(report, tmp_path / name)
        assert path.read_bytes()[:8] == PNG
    for entry in report["settings"].values():
        del entry["system"]["accept_per_position"]
    assert plot_acceptance(report, tmp_path / "none.png").read_bytes()[:8] == PNG


def test_eval_latency_command_writes_json_plots_and_manifest(tiny_chat_checkpoints, tmp_path, gsm8k_dir):
    from qfd.cli import main
    from qfd.manifest import read_manifest

    target = tiny_chat_checkpoints["llama"]
    out = tmp_path / "lat"
    main(["eval", "latency", "--target", str(target), "--baseline", str(target), "--out", str(out), "--device", "cpu",
          "--lengths", "short=8/4,medium=32/4", "--settings", "short,medium", "--warmup", "1", "--runs", "2"])
    report = json.loads((out / "latency.json").read_text())
    assert list(report["settings"]) == ["short", "medium"]
    for entry in report["settings"].values():
        assert entry["system"]["new_tokens_min"] == entry["system"]["new_tokens_max"] == 4  # exact output length
        assert len(entry["system"]["runs_s"]) == 2 and entry["speedup"] > 0
    assert report["mean_speedup"] > 0
    assert (out / "latency.png").read_bytes()[:8] == PNG and (out / "acceptance.png").read_bytes()[:8] == PNG
    manifest = read_manifest(out)
    assert manifest["stage"] == "eval"
    assert {p["role"] for p in manifest["parents"]} == {"target", "baseline"}
    assert "mean_speedup" in manifest["metrics"]
