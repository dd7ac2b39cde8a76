"""`--draft-len auto`: the drafts per step k that this machine serves fastest.

Speculative decoding pays when the tokens a step commits outweigh what the step costs against
one plain decode step:

    speedup(k) = tau(k) * t_decode / t_step(k)

Both sides grow with k. tau(k) grows with diminishing returns (a draft counts only if every
draft before it was accepted); t_step(k) grows with the verify width and the drafter's LM head
- little on a GPU, where a step is launch-bound, a lot on a CPU, where it is compute-bound
(docs/benchmarks.md: on a 2-core CPU k = 15 is a 0.56x slowdown, k = 3 a 1.2-1.4x speedup; on
the H200 k = 15 and k = 7 are within 5%). So k is chosen from measurements on the machine that
serves:

- tau(k) = 1 + sum_{i<=k} prod_{j<=i} a_j, with a_j the drafter's held-out conditional
  acceptance that `qfd draft train` records in its manifest (teacher-forced: served acceptance
  runs ~10% lower, much the same at every k, so the choice stands);
- t_decode and t_step(k): the engine itself, a short greedy generation per k with the engine
  settings that will serve (draft vocabulary, short block, CUDA graphs), timed per step.

The choice only moves speed: every k emits the target's own tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from qfd.errors import QfdError

AUTO = "auto"
CANDIDATES = (1, 2, 3, 4, 5, 7, 11, 15)


def parse_draft_len(value: str | int | None) -> int | str | None:
    """The CLI's --draft-len: None, a positive integer, or "auto"."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise QfdError(f"--draft-len takes a number of drafts per step or 'auto' (got {value!r})") from None


def recorded_acceptance(drafter_dir: Path) -> list[float]:
    """The drafter's held-out conditional acceptance per block position, from its manifest or,
    for a drafter derived from another (`qfd draft vocab` / `quantize` / `swa`: the same or
    nearly the same drafts), from the nearest ancestor's on this machine that records one."""
    from qfd.manifest import read_manifest

    directory, seen = Path(drafter_dir), set()
    while directory is not None and directory.resolve() not in seen:
        seen.add(directory.resolve())
        manifest = read_manifest(directory) or {}
        acceptance = (manifest.get("metrics") or {}).get("conditional_acceptance_per_position")
        if acceptance:
            return [float(a) for a in acceptance]
        parent = next((Path(p["path"]) for p in manifest.get("parents", []) if p.get("role") == "drafter" and p.get("path")), None)
        directory = parent if parent is not None and parent.is_dir() else None
    raise QfdError(f"--draft-len auto: {drafter_dir} records no held-out acceptance (metrics.conditional_acceptance_per_position in qfd.json, written by `qfd draft train`), nor does a drafter it was made from; pass --draft-len K")


def expected_tau(acceptance: Sequence[float], k: int) -> float:
    """Tokens committed per step with k drafts (qfd.drafter_losses.expected_tau)."""
    from qfd.drafter_losses import expected_tau as tau_of

    return tau_of(acceptance[:k])


@dataclass(frozen=True)
class DraftLenChoice:
    k: int
    decode_ms: float
    rows: tuple[dict, ...]  # per candidate: k, tau, step_ms, speedup (projected)
    seconds: float = 0.0  # the measurement's wall time


def choose(acceptance: Sequence[float], decode_ms: float, step_ms: dict[int, float]) -> DraftLenChoice:
    """The k of the highest projected speedup tau(k) * decode_ms / step_ms[k]."""
    rows = tuple({"k": k, "tau": expected_tau(acceptance, k), "step_ms": ms, "speedup": expected_tau(acceptance, k) * decode_ms / ms} for k, ms in sorted(step_ms.items()))
    best = max(rows, key=lambda row: row["speedup"])
    return DraftLenChoice(best["k"], decode_ms, rows)


def ms_per_step(engine, prompt_ids: Sequence[int], new_tokens: int = 16) -> float:
    """Milliseconds per engine step (after the prefill) over a greedy generation, after a
    warm-up generation half as long (a cold first run measured k = 1 ~40% slow on a CPU)."""
    from qfd.engine import GenerationConfig

    engine.generate(list(prompt_ids), GenerationConfig(max_new_tokens=max(2, new_tokens // 2), ignore_eos=True))
    result = engine.generate(list(prompt_ids), GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))
    stats = result.stats
    return (stats.total_s - stats.ttft_s) * 1e3 / max(1, stats.steps)


def auto_draft_len(build_engine: Callable[[int | None], object], acceptance: Sequence[float], block_size: int, prompt_ids: Sequence[int], new_tokens: int = 16) -> DraftLenChoice:
    """Time target-only decoding (build_engine(None)) and one engine per candidate k <= B-1
    (build_engine(k)), then choose. Each engine is dropped after its timing."""
    start = time.perf_counter()
    decode = ms_per_step(build_engine(None), prompt_ids, new_tokens)
    candidates = sorted({k for k in CANDIDATES if k < block_size} | {block_size - 1})
    steps = {k: ms_per_step(build_engine(k), prompt_ids, new_tokens) for k in candidates}
    return replace(choose(acceptance, decode, steps), seconds=time.perf_counter() - start)


def print_choice(choice: DraftLenChoice) -> None:
    from rich.table import Table

    from qfd.console import console

    table = Table(title=f"--draft-len auto: k = {choice.k} (measured in {choice.seconds:.1f} s; target-only decode {choice.decode_ms:.1f} ms/step; tau from the drafter's held-out acceptance: a projection)")
    for column in ("k", "tau (recorded)", "step ms", "projected speedup"):
        table.add_column(column, justify="right")
    for row in choice.rows:
        mark = " <" if row["k"] == choice.k else ""
        table.add_row(str(row["k"]), f"{row['tau']:.2f}", f"{row['step_ms']:.1f}", f"{row['speedup']:.2f}x{mark}")
    console.print(table)


def resolve_draft_len(draft_len: int | str | None, target, tokenizer, drafter, drafter_dir: Path, prompt_ids: Sequence[int], new_tokens: int = 16, **engine_args) -> int | None:
    """`draft_len` as given, or for "auto" the measured choice (printed): engines as the caller
    will build them (`engine_args`: draft_vocab, short_block, cuda_graphs), sized for the
    timing generations only."""
    if draft_len != AUTO:
        return draft_len
    from qfd.engine import Engine

    acceptance = recorded_acceptance(drafter_dir)
    max_len = len(prompt_ids) + new_tokens + 2 * drafter.block_size

    def build(k: int | None):
        if k is None:
            return Engine(target, tokenizer, max_len=max_len, cuda_graphs=engine_args.get("cuda_graphs"))
        return Engine(target, tokenizer, drafter=drafter, max_len=max_len, draft_len=k, **engine_args)

    choice = auto_draft_len(build, acceptance, drafter.block_size, prompt_ids, new_tokens)
    print_choice(choice)
    return choice.k


# What `qfd serve` times the candidates on (it has no prompt yet): plain English prose.
SAMPLE_TEXT = ("The history of science is the study of how people came to understand the natural world, "
               "from the first records of the stars to the experiments of the present day.")


def check_draft_len_or_auto(draft_len: int | str | None, drafter_dir: Path, block_size: int) -> None:
    """Before the long load: a fixed k within the drafter's 1..B-1, or "auto" with the
    drafter's recorded acceptance present."""
    if draft_len == AUTO:
        recorded_acceptance(drafter_dir)
        return
    from qfd.engine import check_draft_len

    check_draft_len(draft_len, block_size)
