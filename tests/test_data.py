"""Prompt loading and target-generated responses (batched, left padded, resumable)."""

from __future__ import annotations

import json

import pytest
import torch

from qfd.data import data_stats, encode_prompt, generate_responses, load_prompts, read_records
from qfd.errors import QfdError


def test_prompt_fields_are_detected(tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": " What? ", "answer": "x"}) + "\n" + json.dumps({"question": "Why?"}) + "\n")
    assert load_prompts(tmp_path / "q.jsonl") == ["What?", "Why?"]
    (tmp_path / "m.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old answer"}]}) + "\n")
    assert load_prompts(tmp_path / "m.jsonl") == [[{"role": "user", "content": "hi"}]]  # trailing assistant turn dropped
    (tmp_path / "custom.jsonl").write_text(json.dumps({"body": "a", "prompt": "b"}) + "\n")
    assert load_prompts(tmp_path / "custom.jsonl") == ["b"]
    assert load_prompts(tmp_path / "custom.jsonl", field="body") == ["a"]
    (tmp_path / "p.txt").write_text("one\n\n two \n")
    assert load_prompts(tmp_path / "p.txt") == ["one", "two"]
    assert load_prompts(tmp_path / "p.txt", limit=1) == ["one"]


def test_prompt_errors_are_clear(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(QfdError, match="--field"):
        load_prompts(tmp_path / "x.jsonl")
    with pytest.raises(QfdError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(QfdError, match="bad.jsonl:1"):
        load_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(QfdError, match="could not be loaded"):
        load_prompts("no-such-dataset-name-here")  # offline in tests


def test_default_prompts_are_gsm8k_train(gsm8k_dir):
    prompts = load_prompts(None, limit=3)
    first = json.loads((gsm8k_dir / "train.jsonl").read_text().splitlines()[0])["question"]
    assert prompts[0] == first.strip() and len(prompts) == 3


def test_chat_template_and_thinking_switch(tiny_chat_checkpoints):
    from qfd.models.hf import load_tokenizer

    tokenizer = load_tokenizer(tiny_chat_checkpoints["llama"])
    ids = encode_prompt(tokenizer, "What is 2+2?")
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text
    raw = encode_prompt(tokenizer, "What is 2+2?", chat=False)
    assert tokenizer.decode(raw) == "What is 2+2?"
    assert encode_prompt(None, [5, 6, 7]) == [5, 6, 7]  # already token ids


def _greedy_reference(model, prompt_ids, n):
    """Unbatched greedy generation: what the batched, left-padded path must reproduce."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


def test_batched_generation_matches_unbatched_and_resumes(tmp_path, tiny_checkpoints):
    from qfd.models.hf import load_hf_causal_lm

    model = load_hf_causal_lm(tiny_checkpoints["llama"])
    model.generation_config.eos_token_id = None  # random weights: keep every response full length
    model.config.eos_token_id = None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 9, 5, 12, 4)]
    out = tmp_path / "data.jsonl"
    records = generate_responses(model, None, prompts[:3], max_new_tokens=6, batch_size=2, out_path=out, progress=False)
    assert [r["index"] for r in records] == [0, 1, 2]
    for record, prompt in zip(records, prompts):
        assert record["prompt_ids"] == prompt
        assert record["response_ids"] == _greedy_reference(model, prompt, 6)
    # Resume: the finished prompts are not regenerated (their lines are kept as they were).
    lines_before = out.read_text().splitlines()
    records = generate_responses(model, None, prompts, max_new_tokens=6, batch_size=2, out_path=out, progress=False)
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    assert out.read_text().splitlines()[:3] == lines_before
    assert records[4]["response_ids"] == _greedy_reference(model, prompts[4], 6)
    assert read_records(out) == records
    assert data_stats(records)["response_tokens"] == 30


def test_responses_stop_at_eos(tiny_checkpoints):
    from qfd.data import _trim_response

    assert _trim_response([5, 6, 2, 0, 0], [2]) == [5, 6, 2]
    assert _trim_response([5, 6], [2]) == [5, 6]
