"""Task functions the YAML templates reference: lm-eval 0.4.13's own, re-exported so the
templates do not depend on lm-eval's directory layout (its task folders are not packages)."""

from __future__ import annotations

from functools import partial

from lm_eval.tasks.gpqa.cot_zeroshot.utils import process_docs as gpqa_process_docs  # noqa: F401
from lm_eval.tasks.mmlu_pro.utils import (  # noqa: F401
    doc_to_text as mmlu_pro_doc_to_text,
    fewshot_to_target as mmlu_pro_fewshot_to_target,
    fewshot_to_text as mmlu_pro_fewshot_to_text,
    process_docs as _mmlu_pro_process_docs,
)

# The 14 MMLU-Pro categories (the `category` column) and the task name of each.
MMLU_PRO_SUBJECTS = {
    "biology": "biology",
    "business": "business",
    "chemistry": "chemistry",
    "computer_science": "computer science",
    "economics": "economics",
    "engineering": "engineering",
    "health": "health",
    "history": "history",
    "law": "law",
    "math": "math",
    "other": "other",
    "philosophy": "philosophy",
    "physics": "physics",
    "psychology": "psychology",
}

for _name, _category in MMLU_PRO_SUBJECTS.items():
    globals()[f"mmlu_pro_process_{_name}"] = partial(_mmlu_pro_process_docs, subject=_category)


def ifeval_process_results(doc, results):
    """lm-eval's IFEval scorer, imported late: its module import needs nltk's punkt_tab,
    which `qfd.nltk_data.ensure_punkt_tab` prepares first."""
    from lm_eval.tasks.ifeval.utils import process_results

    return process_results(doc, results)


def ifeval_agg_inst_level_acc(items):
    from lm_eval.tasks.ifeval.utils import agg_inst_level_acc

    return agg_inst_level_acc(items)
