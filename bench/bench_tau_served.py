"""Served acceptance vs the trainer's held-out estimate, on the same sequences.

    python bench/bench_tau_served.py --target smollm2-135m --drafter DIR [--num 8]
        [--max-new-tokens 256] [--device cpu] [--out tau_served.json]

The drafter trainer reports E[tau] = 1 + sum_k prod_{j<=k} acc_j over blocks at random anchors
(teacher-forced). Serving starts each block where the previous one stopped: right after a
rejected draft, which may be harder than an average position. This script generates greedy
speculative outputs for GSM8K test prompts, then, on exactly those (prompt, output) sequences:

  served       tau measured by the engine (committed tokens per verify step)
  replayed     the engine's walk replayed from teacher-forced block predictions at every
               position (anchor a -> a + accepted + 1): equals `served` up to numerics, which
               checks that training and serving see the same drafter inputs
  random       the trainer's E[tau] over all anchors of those sequences

A gap between `replayed` and `random` is the anchor-selection effect; a gap between `served`
and `replayed` would be a train/serve mismatch (taps, positions, masks, dtype).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def teacher_forced(drafter, frozen, sequences) -> tuple[list[torch.Tensor], float]:
    """Blocks at every anchor of every sequence's response, teacher-forced. Returns, per
    sequence, how many leading drafts of the block at each anchor equal the sequence's next
    tokens, and the trainer's E[tau] over all those blocks."""
    from qfd.drafter_losses import acceptance_counts, acceptance_summary
    from qfd.drafter_trainer import block_passes

    parts = [(seq, torch.arange(seq.prompt_len, seq.ids.numel() - 1)) for seq in sequences]
    totals = [torch.zeros(drafter.block_size - 1, dtype=torch.float64) for _ in range(4)]
    runs = []
    with torch.no_grad():
        for hidden, labels, valid in block_passes(drafter, frozen, parts, pack_tokens=4096):
            correct = frozen.head(hidden).argmax(-1) == labels
            runs.append(torch.cumprod((correct & valid).long(), dim=1).sum(1).cpu())
            for total, part in zip(totals, acceptance_counts(correct, valid)):
                total += part.cpu()
    flat, out, start = torch.cat(runs), [], 0
    for _, anchors in parts:  # block_passes keeps the parts' order
        out.append(flat[start : start + anchors.numel()])
        start += anchors.numel()
    return out, acceptance_summary(*totals)["expected_acceptance_length"]


def replay(accepts: torch.Tensor, draft_len: int) -> list[int]:
    """Committed tokens per step when each step starts where the last one stopped."""
    steps, a = [], 0
    while a < accepts.numel():
        n = min(int(accepts[a]), draft_len)
        steps.append(n + 1)
        a += n + 1
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, type=Path)
    p.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl")
    p.add_argument("--num", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("tau_served.json"))
    args = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    from qfd.checkpoint import resolve_model
    from qfd.drafter_trainer import FrozenTarget, TrainSequence
    from qfd.engine import Engine, GenerationConfig
    from qfd.models.drafter_io import load_drafter
    from qfd.models.hf import load_hf_causal_lm
    from qfd.models.loading import load_target

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_dir = resolve_model(args.target).path
    target, tokenizer = load_target(target_dir, device, dtype)
    drafter = load_drafter(args.drafter, device=device, dtype=dtype, fuse=True)
    engine = Engine(target, tokenizer, drafter=drafter, max_len=2048)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][: args.num]
    sequences, served_steps = [], []
    for row in rows:
        ids = engine.encode([{"role": "user", "content": row["question"]}])
        taus = []
        engine.on_step = lambda s: taus.append(s["accepted"] + 1)
        result = engine.generate(ids, GenerationConfig(max_new_tokens=args.max_new_tokens))
        sequences.append(TrainSequence(torch.tensor(ids + result.tokens), len(ids)))
        served_steps.append(taus)
    engine.on_step = None
    del engine

    frozen = FrozenTarget(load_hf_causal_lm(target_dir, device=device, dtype=dtype), drafter.cfg.target_layer_ids)
    accepts, random_tau = teacher_forced(drafter, frozen, sequences)
    replayed = [replay(a, drafter.block_size - 1) for a in accepts]

    mean = lambda steps: sum(map(sum, steps)) / max(1, sum(map(len, steps)))  # noqa: E731
    result = {
        "sequences": len(sequences),
        "response_tokens": int(sum(s.ids.numel() - s.prompt_len for s in sequences)),
        "served_tau": mean(served_steps),
        "replayed_tau": mean(replayed),
        "random_anchor_tau": random_tau,
        # the last step may differ: serving cuts it at the token budget or EOS
        "identical_walks": sum(a[:-1] == b[:-1] for a, b in zip(replayed, served_steps)),
        "device": str(device),
        "dtype": str(dtype),
    }
    table = Table(title=f"tau on {result['sequences']} GSM8K test outputs ({result['response_tokens']} tokens), {device}, {dtype}")
    for col in ("served (engine)", "replayed (teacher-forced walk)", "random anchors (trainer's E\\[tau])", "walks equal"):
        table.add_column(col, justify="right")
    table.add_row(f"{result['served_tau']:.3f}", f"{result['replayed_tau']:.3f}", f"{result['random_anchor_tau']:.3f}", f"{result['identical_walks']}/{result['sequences']}")
    Console().print(table)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
