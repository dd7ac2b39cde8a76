"""The lm-eval adapter on the synthetic task sets (real schemas, offline): known answers score
1.0, wrong answers 0.0, for each task; MMLU-Pro's mean is unweighted over the 14 subjects and
its 5 shots are multi-turn; thinking follows the task; punkt_tab is prepared offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qfd.errors import QfdError

DATA = Path(__file__).resolve().parent / "data"
TASKS = ("mmlu-pro", "ifeval", "gpqa")


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)


@pytest.fixture(scope="module")
def include_dir(tmp_path_factory):
    from qfd.tasks.data import DEFAULT_MAX_GEN_TOKS, find_task_data, render_tasks

    data = {task: find_task_data(task, DATA, allow_hub=False) for task in TASKS}
    return render_tasks(tmp_path_factory.mktemp("tasks"), data, DEFAULT_MAX_GEN_TOKS)


def _rows(name):
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


class AnswerKeyGenerator:
    """A fake backend that finds the document inside the prompt and answers it from the key:
    right (the correct letter / a compliant response) or wrong (another letter / a violating
    response). `right_categories` limits right answers to some MMLU-Pro categories."""

    def __init__(self, tokenizer, right: bool, right_categories=None):
        self.tokenizer, self.right, self.right_categories = tokenizer, right, right_categories
        self.requests = []
        self.mmlu = {r["question"]: r for r in _rows("mmlu_pro_test.jsonl")}
        self.gpqa = {r["Question"]: r for r in _rows("gpqa_diamond.jsonl")}
        answers = json.loads((DATA / "ifeval_answers.json").read_text())
        self.ifeval = {r["prompt"]: answers[str(r["key"])] for r in _rows("ifeval.jsonl")}

    def generate(self, requests):
        self.requests.extend(requests)
        return [self._answer(r.prompt) for r in requests]

    def _answer(self, prompt):
        for question, row in self.mmlu.items():
            if question in prompt:
                right = self.right and (self.right_categories is None or row["category"] in self.right_categories)
                letter = row["answer"] if right else "ABCDEFGHIJ"[(row["answer_index"] + 1) % 10]
                # Text after the stop string must be cut by the harness, not scored.
                return f"Let's think step by step. The answer is ({letter}).\nQuestion: the answer is (Z)"
        for question, row in self.gpqa.items():
            if question in prompt:
                choices = {k: v.strip() for k, v in re.findall(r"^\(([A-D])\) (.*)$", prompt, flags=re.M)}
                good = next(k for k, v in choices.items() if v == row["Correct Answer"])
                letter = good if self.right else next(k for k in "ABCD" if k != good)
                return f"Reasoning about the system. So the answer is ({letter})."
        for question, answer in self.ifeval.items():
            if question in prompt:
                return answer["right" if self.right else "wrong"]
        raise AssertionError(f"prompt of no known document: {prompt[-200:]}")


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("right", [True, False])
def test_known_answers_score_one_and_wrong_answers_zero(tokenizer, include_dir, task, right):
    from qfd.harness import QfdLM, evaluate_task

    generator = AnswerKeyGenerator(tokenizer, right)
    outcome = evaluate_task(QfdLM(generator), task, include_dir)
    assert outcome["score"] == (1.0 if right else 0.0)
    expected_docs = {"mmlu-pro": 15, "ifeval": 6, "gpqa": 4}[task]
    assert outcome["n"] == expected_docs == len(generator.requests)


def test_mmlu_pro_is_the_unweighted_mean_of_14_subjects_with_5_multiturn_shots(tokenizer, include_dir):
    from qfd.harness import QfdLM, evaluate_task

    # Only math (2 of the 15 test rows) is answered right: unweighted 1/14, weighted 2/15.
    generator = AnswerKeyGenerator(tokenizer, right=True, right_categories={"math"})
    outcome = evaluate_task(QfdLM(generator), "mmlu-pro", include_dir)
    assert len(outcome["subtasks"]) == 14
    assert outcome["subtasks"]["math"] == 1.0
    assert outcome["score"] == pytest.approx(1 / 14)
    prompt = generator.requests[0].prompt
    # 5 shots as earlier chat turns (each an assistant answer), then the question, then the
    # assistant's turn opened for generation; the stop string of the task is passed down.
    assert prompt.count("<|im_start|>assistant") == 6
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    assert prompt.count("The answer is (") == 5
    assert generator.requests[0].stop == ("Question:",) and generator.requests[0].max_new_tokens == 2048


def test_generate_until_cuts_at_stops_caps_budget_and_batches(tokenizer):
    from lm_eval.api.instance import Instance

    from qfd.harness import QfdLM

    class Echo:
        def __init__(self):
            self.tokenizer, self.calls = tokenizer, []

        def generate(self, requests):
            self.calls.append(list(requests))
            return [f"{r.prompt} answer STOP tail" for r in requests]

    gen = Echo()
    lm = QfdLM(gen, max_gen_toks_cap=16, batch_size=2)
    kwargs = {"until": ["STOP"], "max_gen_toks": 512, "do_sample": False, "temperature": 0.7}
    requests = [Instance("generate_until", {}, (f"p{i}", kwargs), i) for i in range(3)]
    out = lm.generate_until(requests)
    assert out == ["p0 answer ", "p1 answer ", "p2 answer "]
    assert [len(c) for c in gen.calls] == [2, 1]
    first = gen.calls[0][0]
    assert first.max_new_tokens == 16 and first.temperature == 0.0 and first.stop == ("STOP",)


def test_thinking_switch_reaches_templates_that_have_it(tokenizer):
    from qfd.harness import QfdLM

    class ThinkingTokenizer:
        chat_template = "{% if enable_thinking %}...{% endif %}"
        name_or_path = "fake/thinking"

        def __init__(self):
            self.kwargs = None

        def apply_chat_template(self, messages, **kwargs):
            self.kwargs = kwargs
            return "templated"

    class Gen:
        tokenizer = ThinkingTokenizer()

    lm = QfdLM(Gen(), enable_thinking=True)
    lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert Gen.tokenizer.kwargs["enable_thinking"] is True
    assert lm.tokenizer_name == "fake__thinking"
    # SmolLM2's template has no switch: the kwarg is not sent at all.
    real = QfdLM(type("G", (), {"tokenizer": tokenizer})(), enable_thinking=True)
    assert "<|im_start|>assistant" in real.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gpqa_runs_with_thinking_on_and_the_protocol_budget(tokenizer, include_dir, monkeypatch):
    from qfd.harness import QfdLM, evaluate_task

    seen = []
    generator = AnswerKeyGenerator(tokenizer, right=True)
    lm = QfdLM(generator)
    original = lm.apply_chat_template
    monkeypatch.setattr(lm, "apply_chat_template", lambda *a, **k: (seen.append(lm.enable_thinking), original(*a, **k))[1])
    evaluate_task(lm, "gpqa", include_dir, limit=1)
    assert seen and all(seen)
    assert generator.requests[0].max_new_tokens == 12288


def test_loglikelihood_is_refused_clearly(tokenizer):
    from qfd.harness import QfdLM

    lm = QfdLM(type("G", (), {"tokenizer": tokenizer})())
    with pytest.raises(NotImplementedError, match="generate-only"):
        lm.loglikelihood([])


def test_truncate_at_stops_takes_the_earliest_stop():
    from qfd.harness import truncate_at_stops

    assert truncate_at_stops("abc STOP def END", ["END", "STOP"]) == "abc "
    assert truncate_at_stops("abc", []) == "abc"
    assert truncate_at_stops("abc", [""]) == "abc"


def test_task_data_checks_schema_and_every_mmlu_pro_category(tmp_path):
    from qfd.tasks.data import find_task_data

    rows = _rows("mmlu_pro_test.jsonl")
    (tmp_path / "mmlu_pro_validation.jsonl").write_text((DATA / "mmlu_pro_validation.jsonl").read_text())
    (tmp_path / "mmlu_pro_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["category"] != "law"))
    with pytest.raises(QfdError, match="law"):
        find_task_data("mmlu-pro", tmp_path, allow_hub=False)
    (tmp_path / "gpqa_diamond.jsonl").write_text(json.dumps({"Question": "q", "Correct Answer": "a"}) + "\n")
    with pytest.raises(QfdError, match="Incorrect Answer 1"):
        find_task_data("gpqa", tmp_path, allow_hub=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(QfdError, match="gpqa_diamond.jsonl"):
        find_task_data("gpqa", empty, allow_hub=False)
    assert find_task_data("gpqa", empty, allow_hub=True).hub == ("Idavidrein/gpqa", "gpqa_diamond")


def test_ifeval_defaults_to_the_shared_benchmark(tmp_path):
    from qfd.tasks.data import SHARED_DATA, find_task_data

    if not (SHARED_DATA / "ifeval" / "input_data.jsonl").is_file():
        pytest.skip("../shared/data/ifeval not present")
    data = find_task_data("ifeval", None, allow_hub=False)
    assert data.files["train"].name == "input_data.jsonl"


def test_punkt_tab_is_prepared_offline(tmp_path, monkeypatch):
    import nltk

    from qfd.nltk_data import PUNKT_FILES, ensure_punkt_tab, punkt_tab_dir

    monkeypatch.delenv("NLTK_DATA", raising=False)
    monkeypatch.setattr(nltk.data, "path", [])  # nothing else to fall back on
    root = ensure_punkt_tab(tmp_path / "nltk")
    assert all((punkt_tab_dir(root) / name).stat().st_size > 0 for name in PUNKT_FILES)
    assert nltk.data.find("tokenizers/punkt_tab/english/")
    text = "Mr. Smith met Dr. Jones at 5 p.m. yesterday. They talked for an hour. Then they left!"
    assert nltk.sent_tokenize(text) == ["Mr. Smith met Dr. Jones at 5 p.m. yesterday.", "They talked for an hour.", "Then they left!"]


@pytest.mark.slow
def test_hf_backend_on_the_embedded_model_runs_ifeval(embedded_model_dir, include_dir):
    import torch

    from qfd.harness import HFGenerator, QfdLM, evaluate_task

    generator = HFGenerator.from_dir(embedded_model_dir, "cpu", torch.float32)
    outcome = evaluate_task(QfdLM(generator, max_gen_toks_cap=8, batch_size=2), "ifeval", include_dir, limit=2)
    assert outcome["n"] == 2 and 0.0 <= outcome["score"] <= 1.0
    responses = [row["response"] for row in outcome["samples"]["ifeval"]]
    assert all(r and r.strip() for r in responses)
