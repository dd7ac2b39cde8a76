"""`qfd generate` and the decode loop under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qfd.cli import main
from qfd.stages.generate import TextStream, decode, sample_next
from tests.tiny import FAMILIES


def _run_cli(args, capsys):
    """(exit code, stdout, stderr) of `qfd generate ARGS` run in-process."""
    code = 0
    try:
        main(["generate", *args])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _bad_inputs(root: Path, tiny: Path) -> dict[str, tuple[str, str]]:
    """case -> (target spec, expected words in the error line)."""
    (root / "empty").mkdir()
    (root / "notmodel").mkdir()
    (root / "notmodel" / "notes.txt").write_text("hello")
    arch = root / "arch"
    arch.mkdir()
    (arch / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (arch / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    truncated = root / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text((tiny / "config.json").read_text())
    data = (tiny / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    return {
        "missing": (str(root / "nowhere"), "does not exist"),
        "empty": (str(root / "empty"), "empty"),
        "not a model": (str(root / "notmodel"), "config.json"),
        "architecture": (str(arch), "unsupported architecture"),
        "truncated": (str(truncated), "truncated"),
        "unknown name": ("smollm9-7b", "unknown model"),
    }


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    (tmp_path / "inputs").mkdir()
    cases = _bad_inputs(tmp_path / "inputs", tiny_checkpoints["llama"])
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = _snapshot(tmp_path)
    for case, (spec, words) in cases.items():
        code, out, err = _run_cli(["--target", spec, "--prompt", "hi"], capsys)
        assert code == 2, case
        lines = err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (case, err)
        assert "Traceback" not in err and out == "", case
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("flags, words", [(["--max-new-tokens", "0"], "max-new-tokens"), (["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top-p"), (["--device", "tpu"], "device"), (["--dtype", "int3"], "dtype")])
def test_bad_flags_exit_2(tiny_chat_checkpoints, capsys, flags, words):
    code, _, err = _run_cli(["--target", str(tiny_chat_checkpoints["llama"]), "--prompt", "hi", *flags], capsys)
    assert code == 2 and words in err and "Traceback" not in err


def test_model_without_tokenizer_is_a_user_error(tiny_checkpoints, capsys):
    code, _, err = _run_cli(["--target", str(tiny_checkpoints["llama"]), "--prompt", "hi", "--device", "cpu"], capsys)
    assert code == 2 and "tokenizer" in err


def test_streams_text_to_stdout_and_stats_to_stderr(tiny_chat_checkpoints, capsys):
    from transformers import AutoTokenizer

    directory = tiny_chat_checkpoints["qwen3_5"]
    code, out, err = _run_cli(["--target", str(directory), "--prompt", "Hello", "--chat", "--max-new-tokens", "6", "--device", "cpu"], capsys)
    assert code == 0, err
    assert "tokens/s" in err and "time to first token" in err
    # stdout is exactly the decoded greedy continuation (plus the closing newline)
    from qfd.models.loading import load_target
    from qfd.stages.generate import encode_prompt

    model, tokenizer = load_target(directory)
    ids = encode_prompt(tokenizer, "Hello", chat=True)
    result = decode(model, ids, max_new_tokens=6, stop_ids=(tokenizer.eos_token_id,))
    assert out == AutoTokenizer.from_pretrained(directory).decode(result.tokens, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_equals_transformers_generate(tiny_checkpoints, family):
    from transformers import AutoModelForCausalLM

    from qfd.models.loading import load_target

    directory = tiny_checkpoints[family]
    model, _ = load_target(directory)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.randint(3, 512, (1, 11), generator=torch.Generator().manual_seed(1))
    # transformers stops at eos (id 2 in the tiny configs), so stop there too
    reference = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 11:].tolist()
    result = decode(model, prompt[0].tolist(), max_new_tokens=12, stop_ids=(2,))
    assert result.tokens == reference
    assert result.stopped == (reference[-1] == 2) and result.ttft_s <= result.total_s


def test_decode_stops_at_a_stop_token(tiny_checkpoints):
    from qfd.models.loading import load_target

    model, _ = load_target(tiny_checkpoints["llama"])
    free = decode(model, [5, 6, 7], max_new_tokens=8)
    stop = free.tokens[3]
    stopped = decode(model, [5, 6, 7], max_new_tokens=8, stop_ids=(stop,))
    assert stopped.tokens == free.tokens[: free.tokens.index(stop) + 1] and stopped.stopped


def test_sampling_rules():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    greedy = sample_next(logits)
    assert greedy.item() == 0
    gen = torch.Generator().manual_seed(0)
    assert all(sample_next(logits, 1.0, top_k=1, generator=gen).item() == 0 for _ in range(20))
    assert all(sample_next(logits, 1.0, top_p=0.05, generator=gen).item() == 0 for _ in range(20))
    # top_k=2 never leaves the two best tokens; seeded runs repeat
    draws = [sample_next(logits, 1.0, top_k=2, generator=gen).item() for _ in range(200)]
    assert set(draws) == {0, 1}
    a = [sample_next(logits, 0.7, generator=torch.Generator().manual_seed(3)).item() for _ in range(5)]
    b = [sample_next(logits, 0.7, generator=torch.Generator().manual_seed(3)).item() for _ in range(5)]
    assert a == b
    # temperature 1 without filters samples softmax(logits): frequencies within 4 sigma
    n = 20000
    counts = torch.bincount(torch.stack([sample_next(logits.expand(n, -1), 1.0, generator=gen)]).flatten(), minlength=5).float()
    p = logits.softmax(-1)[0]
    assert ((counts / n - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9).all()


def test_text_stream_holds_back_incomplete_characters():
    class ByteTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    pieces: list[str] = []
    stream = TextStream(ByteTokenizer(), pieces.append)
    for byte in "é!".encode():
        stream([byte])
    assert pieces == ["é", "!"]


@pytest.mark.slow
def test_smollm2_chat_answers_paris():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "qfd", "generate", "--target", "smollm2-135m", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "24", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tokens/s" in proc.stderr


def test_dependency_import_noise_is_silenced():
    """gptqmodel's import pulls in torchao, which logs every prebuilt kernel that does not load
    with this torch; qfd's entry point keeps that out of the user's terminal."""
    code = "import sys; from qfd.cli import _quiet_dependency_logs; {}; import gptqmodel"
    loud = subprocess.run([sys.executable, "-c", code.format("pass")], capture_output=True, text=True)
    quiet = subprocess.run([sys.executable, "-c", code.format("_quiet_dependency_logs()")], capture_output=True, text=True)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    for noise in ("Failed to load", "register_constant"):
        assert noise not in quiet.stderr, quiet.stderr[-2000:]
    if "Failed to load" not in loud.stderr:
        pytest.skip("torchao loads cleanly here: nothing to silence")
