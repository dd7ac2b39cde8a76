"""The latency protocol (method.md section 5) and its plots.

Raw completion (no chat template), temperature 0, exact input/output lengths per setting
(short 64/128, medium 2048/256, long 8192/256), 5 warm-ups, the median of N timed runs;
speedup per setting against a BF16 target-only baseline on the same engine and hardware, the
mean of those speedups, tau (mean acceptance length, bonus token included), tokens/s and the
per-position acceptance rates. Prompts are real prose - GSM8K test questions concatenated and
cut by tokens to the exact input length - because repeated filler inflates acceptance.

The protocol runs over a `TimedGenerate` callable, so it is tested with a fake and runs on
qfd's engine (`engine_timed_generate`) or a transformers model (`hf_timed_generate`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from qfd.errors import QfdError

DEFAULT_LENGTHS = {"short": (64, 128), "medium": (2048, 256), "long": (8192, 256)}


@dataclass(frozen=True)
class Setting:
    name: str
    input_len: int
    output_len: int


@dataclass(frozen=True)
class RunResult:
    """One timed completion. accept_per_position[k]: fraction of verify steps whose draft
    token k+1 was accepted (None without a drafter)."""

    seconds: float
    new_tokens: int
    tau: float | None = None
    accept_per_position: tuple[float, ...] | None = None
    steps: int | None = None


TimedGenerate = Callable[[list[int], int], RunResult]  # (prompt ids, exact new tokens) -> RunResult


def parse_lengths(spec: str | None) -> dict[str, tuple[int, int]]:
    """'short=64/128,medium=2048/256' -> {"short": (64, 128), ...}; None -> the protocol's."""
    lengths = dict(DEFAULT_LENGTHS)
    for item in filter(None, (spec or "").split(",")):
        try:
            name, pair = item.split("=")
            inp, out = (int(x) for x in pair.split("/"))
        except ValueError:
            raise QfdError(f"bad --lengths item '{item}': write NAME=IN/OUT, e.g. short=64/128") from None
        if inp < 1 or out < 1:
            raise QfdError(f"--lengths {item}: lengths must be >= 1")
        lengths[name.strip()] = (inp, out)
    return lengths


def build_settings(names: Sequence[str], lengths: dict[str, tuple[int, int]], scale: float = 1.0) -> list[Setting]:
    """Settings in the order asked; `scale` shrinks every length (CPU demos), at least 1 token."""
    if scale <= 0:
        raise QfdError(f"--scale must be > 0 (got {scale})")
    unknown = [n for n in names if n not in lengths]
    if unknown:
        raise QfdError(f"unknown latency setting(s) {', '.join(unknown)}; known: {', '.join(lengths)} (add more with --lengths NAME=IN/OUT)")
    return [Setting(n, max(1, round(lengths[n][0] * scale)), max(1, round(lengths[n][1] * scale))) for n in names]


def read_questions(path: Path) -> list[str]:
    """GSM8K-style JSONL ({"question": ...}) -> the question texts."""
    path = Path(path)
    if not path.is_file():
        raise QfdError(f"latency prompt file {path} not found; pass --prompts with a JSONL of {{\"question\": ...}} rows")
    questions = [json.loads(line)["question"].strip() for line in path.read_text().splitlines() if line.strip()]
    if not questions:
        raise QfdError(f"{path} holds no questions")
    return questions


def prose_prompt(questions: Sequence[str], tokenizer: Any, length: int, offset: int) -> list[int]:
    """Exactly `length` token ids of real prose: questions from `offset` on (wrapping), joined
    by blank lines and tokenized as one text (natural token boundaries), then cut."""
    pieces, ids, i = [], [], offset
    while len(ids) < length:
        # Grow the text geometrically: re-tokenizing the whole text keeps boundaries natural.
        for _ in range(max(1, len(pieces))):
            pieces.append(questions[i % len(questions)])
            i += 1
        ids = tokenizer("\n\n".join(pieces), add_special_tokens=False)["input_ids"]
        if i - offset > 4 * len(questions) + length:
            raise QfdError("the latency prompts tokenize to nothing; check the prompt file and tokenizer")
    return list(ids[:length])


def build_prompts(questions: Sequence[str], tokenizer: Any, length: int, count: int, stride: int = 7) -> list[list[int]]:
    """`count` different prompts of exactly `length` tokens (prompt i starts at question i*stride)."""
    return [prose_prompt(questions, tokenizer, length, (k * stride) % len(questions)) for k in range(count)]


def measure(generate: TimedGenerate, prompts: Sequence[list[int]], output_len: int, warmup: int, runs: int,
            advance: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Warm up on the first `warmup` prompts, time the next `runs`; summary of the timed runs."""
    if len(prompts) < warmup + runs:
        raise ValueError(f"need {warmup + runs} prompts, got {len(prompts)}")
    for prompt in prompts[:warmup]:
        generate(list(prompt), output_len)
        if advance:
            advance(1)
    results = []
    for prompt in prompts[warmup : warmup + runs]:
        results.append(generate(list(prompt), output_len))
        if advance:
            advance(1)
    return summarize(results, output_len)


def summarize(results: Sequence[RunResult], output_len: int) -> dict[str, Any]:
    seconds = [r.seconds for r in results]
    median = statistics.median(seconds)
    new_tokens = [r.new_tokens for r in results]
    summary: dict[str, Any] = {
        "median_s": median,
        "mean_s": statistics.fmean(seconds),
        "runs_s": seconds,
        "new_tokens_min": min(new_tokens),
        "new_tokens_max": max(new_tokens),
        "exact_output_len": all(n == output_len for n in new_tokens),
        "tokens_per_s": statistics.fmean(new_tokens) / median if median > 0 else float("inf"),
        "ms_per_token": 1000 * median / max(1, statistics.fmean(new_tokens)),
    }
    taus = [r.tau for r in results if r.tau is not None]
    if taus:
        summary["tau"] = statistics.fmean(taus)
    rates = [r.accept_per_position for r in results if r.accept_per_position]
    if rates:
        width = max(len(r) for r in rates)
        summary["accept_per_position"] = [statistics.fmean(r[k] for r in rates if len(r) > k) for k in range(width)]
    return summary


def add_speedups(report: dict[str, Any]) -> dict[str, Any]:
    """speedup = baseline median / system median per setting, and their mean (in place)."""
    speedups = []
    for entry in report["settings"].values():
        if "baseline" in entry and "system" in entry:
            entry["speedup"] = entry["baseline"]["median_s"] / entry["system"]["median_s"]
            speedups.append(entry["speedup"])
    if speedups:
        report["mean_speedup"] = statistics.fmean(speedups)
    taus = [e["system"]["tau"] for e in report["settings"].values() if "tau" in e.get("system", {})]
    if taus:
        report["mean_tau"] = statistics.fmean(taus)
    return report


# --- plots -----------------------------------------------------------------------------------
def plot_latency(report: dict[str, Any], path: Path) -> Path:
    """Grouped bars: median latency per setting, baseline vs system, speedup on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["settings"])
    roles = [r for r in ("baseline", "system") if any(r in report["settings"][n] for n in names)]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(names), 3.6))
    width = 0.8 / len(roles)
    for j, role in enumerate(roles):
        values = [report["settings"][n].get(role, {}).get("median_s", 0.0) for n in names]
        bars = ax.bar([i + (j - (len(roles) - 1) / 2) * width for i in range(len(names))], values, width, label=report.get("labels", {}).get(role, role))
        ax.bar_label(bars, fmt="%.3g s", fontsize=7)
    for i, n in enumerate(names):
        if "speedup" in report["settings"][n]:
            top = max(report["settings"][n][r]["median_s"] for r in roles)
            ax.annotate(f"{report['settings'][n]['speedup']:.2f}x", (i, top * 1.12), ha="center", fontsize=9, weight="bold")
    ax.set_xticks(range(len(names)), [f"{n}\n{report['settings'][n]['input_len']}/{report['settings'][n]['output_len']}" for n in names])
    ax.set_ylabel("median latency (s)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
    title = "latency per setting"
    if "mean_speedup" in report:
        title += f" (mean speedup {report['mean_speedup']:.2f}x)"
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_acceptance(report: dict[str, Any], path: Path) -> Path:
    """Acceptance rate per draft position, one line per setting (empty axes without a drafter)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    drew = False
    for name, entry in report["settings"].items():
        rates = entry.get("system", {}).get("accept_per_position")
        if rates:
            label = f"{name} (tau {entry['system']['tau']:.2f})" if "tau" in entry["system"] else name
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
            drew = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    if drew:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no drafter: target-only decoding", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("acceptance per draft position")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# --- backends --------------------------------------------------------------------------------
def _synchronize(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def engine_timed_generate(engine: Any, device: Any = "cpu") -> TimedGenerate:
    """Time qfd's engine. The output length is exact when the engine's GenerationConfig can
    ignore EOS (`ignore_eos` or `min_new_tokens`); otherwise the counts are reported."""
    import dataclasses

    from qfd.engine import GenerationConfig

    fields = {f.name for f in dataclasses.fields(GenerationConfig)}

    def run(prompt: list[int], new_tokens: int) -> RunResult:
        extra = {}
        if "ignore_eos" in fields:
            extra["ignore_eos"] = True
        elif "min_new_tokens" in fields:
            extra["min_new_tokens"] = new_tokens
        config = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, **extra)
        _synchronize(device)
        start = time.perf_counter()
        result = engine.generate(prompt, config)
        _synchronize(device)
        seconds = time.perf_counter() - start
        stats = result.stats
        rates = getattr(stats, "accept_per_position", None)
        tau = getattr(stats, "tau", None)
        # Without a drafter the engine reports tau as NaN and no rates: there is no acceptance.
        has_drafter = getattr(engine, "drafter", None) is not None
        tau = float(tau) if has_drafter and tau is not None and tau == tau else None
        rates = tuple(float(r) for r in rates) if has_drafter and rates is not None and len(rates) else None
        return RunResult(seconds, len(result.tokens), tau, rates, getattr(stats, "steps", None))

    return run


def hf_timed_generate(model: Any) -> TimedGenerate:
    """Time a transformers model's greedy generate with exactly `new_tokens` new tokens."""
    import torch

    def run(prompt: list[int], new_tokens: int) -> RunResult:
        ids = torch.tensor([prompt], device=model.device)
        _synchronize(model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
        _synchronize(model.device)
        return RunResult(time.perf_counter() - start, out.shape[1] - ids.shape[1])

    return run
