"""Task data for the quality gates: find local JSONL files, check their schema, and render the
YAML templates of this package into an lm-eval `--include_path` directory.

Offline, lm-eval's built-in tasks fail to reach the Hub; a YAML task with `dataset_path: json`,
`dataset_name: null` and `dataset_kwargs.data_files` per split reads local files instead
(environment.md). File names looked for in `--data-dir` (also one folder down, e.g.
`DIR/ifeval/input_data.jsonl`):

    ifeval:    ifeval.jsonl | input_data.jsonl          (key, prompt, instruction_id_list, kwargs)
    mmlu-pro:  mmlu_pro_test.jsonl + mmlu_pro_validation.jsonl
               (question_id, question, options, answer, answer_index, cot_content, category, src)
    gpqa:      gpqa_diamond.jsonl                       (Question, Correct Answer, Incorrect Answer 1..3)
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from qfd.errors import QfdError

TEMPLATES = Path(__file__).resolve().parent
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"

# CLI task name -> lm-eval task (or group) name registered by the rendered YAML.
LM_EVAL_TASK = {"mmlu-pro": "mmlu_pro", "ifeval": "ifeval", "gpqa": "gpqa_diamond_cot_zeroshot"}
# split -> candidate file names, per task.
FILE_NAMES = {
    "ifeval": {"train": ("ifeval.jsonl", "input_data.jsonl")},
    "mmlu-pro": {"test": ("mmlu_pro_test.jsonl",), "validation": ("mmlu_pro_validation.jsonl",)},
    "gpqa": {"train": ("gpqa_diamond.jsonl",)},
}
SCHEMA = {
    "ifeval": ("key", "prompt", "instruction_id_list", "kwargs"),
    "mmlu-pro": ("question_id", "question", "options", "answer", "answer_index", "cot_content", "category", "src"),
    "gpqa": ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"),
}
# Where each task lives on the Hub, for machines that can reach it.
HUB_DATASET = {
    "ifeval": ("google/IFEval", None),
    "mmlu-pro": ("TIGER-Lab/MMLU-Pro", None),
    "gpqa": ("Idavidrein/gpqa", "gpqa_diamond"),
}
# Protocol budgets of new tokens (lm-eval's configs; GPQA with thinking: method.md section 5).
DEFAULT_MAX_GEN_TOKS = {"ifeval": 1280, "mmlu-pro": 2048, "gpqa": 12288}


@dataclass(frozen=True)
class TaskData:
    """Where one task's rows come from: local files per split, or a Hub dataset."""

    task: str
    files: dict[str, Path] = field(default_factory=dict)
    hub: tuple[str, str | None] | None = None

    def describe(self) -> str:
        if self.hub:
            return f"hub:{self.hub[0]}" + (f"/{self.hub[1]}" if self.hub[1] else "")
        return ", ".join(f"{split}={path}" for split, path in self.files.items())


def find_task_data(task: str, data_dir: Path | None, allow_hub: bool) -> TaskData:
    """Local files in `data_dir` (or, for IFEval, ../shared/data/ifeval), else the Hub."""
    search = [Path(data_dir)] if data_dir is not None else []
    if task == "ifeval":
        search.append(SHARED_DATA / "ifeval")
    files: dict[str, Path] = {}
    for split, names in FILE_NAMES[task].items():
        for root in search:
            hit = _first_file(root, names)
            if hit is not None:
                files[split] = hit
                break
    if len(files) == len(FILE_NAMES[task]):
        validate_task_files(task, files)
        return TaskData(task, files=files)
    wanted = " + ".join(" | ".join(n) for n in FILE_NAMES[task].values())
    if allow_hub:
        return TaskData(task, hub=HUB_DATASET[task])
    where = f"in {data_dir}" if data_dir else "(no --data-dir given)"
    raise QfdError(f"no local data for {task} {where}: put {wanted} in --data-dir, or run where the Hugging Face Hub is reachable")


def _first_file(root: Path, names: tuple[str, ...]) -> Path | None:
    for name in names:
        for candidate in (root / name, *sorted(root.glob(f"*/{name}"))):
            if candidate.is_file():
                return candidate.resolve()
    return None


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise QfdError(f"{path} line {number} is not JSON ({exc.msg}); fix or regenerate the file") from None
    if not rows:
        raise QfdError(f"{path} holds no rows")
    return rows


def validate_task_files(task: str, files: dict[str, Path]) -> None:
    """Fail before any generation when a file lacks the columns lm-eval's task reads, or when
    an MMLU-Pro category has no test row (its subtask would be empty and lm-eval stops)."""
    per_split = {split: read_jsonl(path) for split, path in files.items()}
    for split, rows in per_split.items():
        missing = [key for key in SCHEMA[task] if key not in rows[0]]
        if missing:
            raise QfdError(f"{files[split]} lacks the {task} column(s) {', '.join(missing)}; expected {', '.join(SCHEMA[task])}")
    if task == "mmlu-pro":
        from qfd.tasks.functions import MMLU_PRO_SUBJECTS

        for split, need in (("test", 1), ("validation", 1)):
            counts = Counter(row["category"] for row in per_split[split])
            empty = [c for c in MMLU_PRO_SUBJECTS.values() if counts[c] < need]
            if empty:
                raise QfdError(f"{files[split]} has no {split} row for the MMLU-Pro categor{'y' if len(empty) == 1 else 'ies'} {', '.join(empty)}; all 14 are needed")


def _dataset_block(data: TaskData) -> str:
    if data.hub:
        path, name = data.hub
        return f"dataset_path: {path}\ndataset_name: {name if name else 'null'}"
    lines = ["dataset_path: json", "dataset_name: null", "dataset_kwargs:", "  data_files:"]
    lines += [f"    {split}: {json.dumps(str(path))}" for split, path in data.files.items()]
    return "\n".join(lines)


def render_tasks(out_dir: Path, data: dict[str, TaskData], max_gen_toks: dict[str, int]) -> Path:
    """Write the YAML group for `data`'s tasks into `out_dir` (an lm-eval include path)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def fill(text: str, task: str) -> str:
        return text.replace("@DATASET@", _dataset_block(data[task])).replace("@MAX_GEN_TOKS@", str(int(max_gen_toks[task])))

    if "ifeval" in data:
        (out_dir / "ifeval.yaml").write_text(fill((TEMPLATES / "ifeval.yaml").read_text(), "ifeval"))
    if "gpqa" in data:
        name = "gpqa_diamond_cot_zeroshot.yaml"
        (out_dir / name).write_text(fill((TEMPLATES / name).read_text(), "gpqa"))
    if "mmlu-pro" in data:
        from qfd.tasks.functions import MMLU_PRO_SUBJECTS

        (out_dir / "_mmlu_pro_template_yaml").write_text(fill((TEMPLATES / "_mmlu_pro_template_yaml").read_text(), "mmlu-pro"))
        subject = (TEMPLATES / "mmlu_pro_subject.yaml.in").read_text()
        for name, category in MMLU_PRO_SUBJECTS.items():
            (out_dir / f"mmlu_pro_{name}.yaml").write_text(subject.replace("@NAME@", name).replace("@CATEGORY@", category))
        subtasks = "\n".join(f"  - mmlu_pro_{name}" for name in MMLU_PRO_SUBJECTS)
        (out_dir / "_mmlu_pro.yaml").write_text((TEMPLATES / "_mmlu_pro.yaml").read_text().replace("@SUBTASKS@", subtasks))
    return out_dir
