"""Presets for `qfd all`: the flags each stage gets.

demo: the embedded SmolLM2-135M on a 2-core CPU in about 12 minutes - small data, short
training with fixed step counts, scaled-down latency lengths, 8 IFEval prompts. Numbers it
prints are real measurements of that small run, not of the paper's setting.
quick: every stage on the embedded model with the least work that still exercises it (about
5 minutes on 2 CPU cores): a check that the pipeline runs on a box, and CI's end-to-end test.
Apart from QAD's held-out KL its numbers say nothing about quality or speed.
qwen3.5-4b: the paper's hyperparameters (method.md) for a GPU box.
"""

from __future__ import annotations

from typing import Any

from qfd.stages.all import Paths, Step

PRESETS: dict[str, dict[str, Any]] = {
    "demo": {
        "model": "smollm2-135m",
        "quantize": ["--method", "gptq", "--samples", "32"],
        # lr 1e-3: at a few dozen steps a smaller lr moves almost no latent across a grid
        # boundary (measured: lr 1e-4, 100 steps -> 18 codes changed, KL unchanged; lr 1e-3,
        # 80 steps of 2 x 64 tokens -> held-out KL 0.352 -> 0.147 in 4 minutes on 2 cores)
        "qad": ["--generate-samples", "48", "--generate-tokens", "96", "--steps", "60", "--seq-len", "64", "--batch-size", "2", "--eval-every", "30", "--lr", "1e-3"],
        "data": ["--num", "96", "--max-new-tokens", "128", "--batch-size", "16"],
        # Fixed step counts, not --max-minutes: a time cap cuts a schedule planned for more
        # steps part-way (measured: 17 of 608 steps, still in warm-up, E[tau] 1.06).
        "draft1": ["--layers", "2", "--lr", "2e-3", "--steps", "60", "--grad-accum", "1", "--max-anchors", "32"],
        "draft2": ["--lr", "5e-4", "--steps", "20", "--grad-accum", "1", "--max-anchors", "32"],
        # SmolLM2's widths (576, 1536) are not multiples of the paper's 128
        "draft_quantize": ["--samples", "32", "--group-size", "64"],
        "swa": ["--window", "1024"],
        "latency": ["--scale", "0.05", "--warmup", "1", "--runs", "3", "--draft-len", "auto"],
        # through the served path (target + a demo drafter that accepts little on CPU): 16 prompts
        # x 256 tokens took 18.5 of the demo's 35.5 minutes on 2 cores at k = 15 (before
        # --draft-len auto, which on a CPU picks a short k: every eval step times the ks first)
        "quality": ["ifeval", "--limit", "8", "--max-gen-toks", "128", "--draft-len", "auto"],
    },
    "quick": {
        "model": "smollm2-135m",
        "quantize": ["--method", "rtn"],
        # enough QAD to show its effect (measured: held-out KL -17.5% in 40 steps, 2 minutes)
        "qad": ["--generate-samples", "16", "--generate-tokens", "64", "--steps", "40", "--seq-len", "48", "--batch-size", "2", "--eval-every", "20", "--eval-blocks", "4", "--lr", "2e-3"],
        "data": ["--num", "12", "--max-new-tokens", "32", "--batch-size", "12"],
        "draft1": ["--layers", "1", "--steps", "6", "--grad-accum", "1", "--max-anchors", "8", "--max-eval", "2"],
        "draft2": ["--steps", "3", "--grad-accum", "1", "--max-anchors", "8", "--max-eval", "2"],
        "draft_quantize": ["--samples", "4", "--anchors-per-sample", "4", "--group-size", "64"],
        "swa": ["--window", "1024"],
        "latency": ["--scale", "0.02", "--warmup", "0", "--runs", "1", "--draft-len", "auto"],
        "quality": ["ifeval", "--limit", "2", "--max-gen-toks", "16", "--draft-len", "auto"],
    },
    "qwen3.5-4b": {
        "model": "Qwen/Qwen3.5-4B",
        "quantize": ["--method", "awq", "--group-size", "128", "--samples", "256"],
        # method.md: lr 2e-6, cosine, warmup 3%, wd 0, clip 1.0; teacher-generated chat text
        "qad": ["--generate-samples", "4096", "--generate-tokens", "1024", "--steps", "2000", "--seq-len", "2048", "--batch-size", "4", "--grad-accum", "8", "--lr", "2e-6", "--eval-every", "200"],
        "data": ["--num", "20000", "--max-new-tokens", "2048", "--batch-size", "64"],
        # method.md: AdamW lr 6e-4..1e-3, warmup 4%, clip 1.0, max length 3072, 512 anchors
        "draft1": ["--lr", "6e-4", "--epochs", "6", "--grad-accum", "8", "--max-anchors", "512", "--max-len", "3072"],
        "draft2": ["--lr", "3e-4", "--epochs", "2", "--grad-accum", "8", "--max-anchors", "512", "--max-len", "3072"],
        "draft_quantize": ["--samples", "256", "--anchors-per-sample", "16", "--group-size", "128"],
        "swa": ["--window", "1024"],
        "latency": ["--warmup", "5", "--runs", "50", "--draft-len", "auto"],
        "quality": ["mmlu-pro", "ifeval", "gpqa", "--draft-len", "auto"],
    },
}


def steps_for(preset: dict[str, Any], quality: bool = True) -> list[Step]:
    """The pipeline of one preset, in order (see qfd.stages.all)."""

    def out(paths: Paths, subdir: str) -> list[str]:
        return ["--out", str(paths[subdir]), "--device", paths.device]

    steps = [
        Step("quantize", "1-quantize", "quantize",
             lambda p: ["quantize", "--model", p.model, *preset["quantize"], "--out", str(p["1-quantize"])],
             enabled=lambda p: p.ckpt is None),
        Step("qad", "2-qad", "qad",
             lambda p: ["qad", "--ckpt", str(p.int4), "--teacher", p.model, *preset["qad"], *out(p, "2-qad")]),
        Step("data-bf16", "3-data-bf16", "draft-data",
             lambda p: ["draft", "data", "--target", p.model, *preset["data"], *out(p, "3-data-bf16")]),
        Step("draft-stage1", "4-draft-stage1", "draft-stage1",
             lambda p: ["draft", "train", "--stage", "1", "--target", p.model, "--data", str(p["3-data-bf16"]), *preset["draft1"], *out(p, "4-draft-stage1")]),
        Step("data-int4", "5-data-int4", "draft-data",
             lambda p: ["draft", "data", "--target", str(p["2-qad"]), *preset["data"], *out(p, "5-data-int4")]),
        Step("draft-stage2", "6-draft-stage2", "draft-stage2",
             lambda p: ["draft", "train", "--stage", "2", "--target", str(p["2-qad"]), "--init", str(p["4-draft-stage1"]), "--data", str(p["5-data-int4"]), *preset["draft2"], *out(p, "6-draft-stage2")]),
        Step("draft-quantize", "7-draft-quantize", "draft-quantize",
             lambda p: ["draft", "quantize", "--drafter", str(p["6-draft-stage2"]), "--target", str(p["2-qad"]), "--data", str(p["5-data-int4"]), *preset["draft_quantize"], *out(p, "7-draft-quantize")]),
        Step("draft-swa", "8-draft-swa", "draft-swa",
             lambda p: ["draft", "swa", "--drafter", str(p["7-draft-quantize"]), *preset["swa"], *out(p, "8-draft-swa")]),
        Step("eval-latency", "9-eval-latency", "eval",
             lambda p: ["eval", "latency", "--target", str(p["2-qad"]), "--drafter", str(p["8-draft-swa"]), "--baseline", p.model, *preset["latency"], *out(p, "9-eval-latency")]),
    ]
    if quality:
        steps.append(Step("eval-quality", "10-eval-quality", "eval",
                          lambda p: ["eval", *preset["quality"], "--target", str(p["2-qad"]), "--drafter", str(p["8-draft-swa"]), *out(p, "10-eval-quality")]))
    return steps
