"""YAML templates for the offline lm-eval task group (rendered by `qfd.harness.render_tasks`).

Each template mirrors lm-eval 0.4.13's own task config (`lm_eval/tasks/{mmlu_pro,ifeval,gpqa}`)
in full, because inline dict overrides of a registered task do not inherit its config; only
the dataset block (`@DATASET@`) and the generation budget (`@MAX_GEN_TOKS@`) are filled in per
run. Functions are referenced by importable module path (`qfd.tasks.functions.*`).
"""
