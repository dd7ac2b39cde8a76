"""What a draft tree would accept, replayed exactly from teacher-forced drafter outputs.

    python bench/bench_tree_acceptance.py --target smollm2-135m --drafter DIR [--num 16]
        [--max-new-tokens 256] [--sizes 16,32,64] [--widths 4,8] [--device cpu] [--out tree_tau.json]

Generates the target's greedy outputs for GSM8K test prompts, then runs the drafter
teacher-forced at every position of them (the trainer's block passes) and records, per draft
slot, the rank of the target's next token among the drafter's candidates and the top-W
log-probabilities. Since every slot of a DFlash block is predicted from the same context, that
is enough to replay any verification walk exactly: each step starts where the previous one
stopped and keeps the longest tree path the target agrees with.

Rows: the chain (k = B-1); the unbounded top-2 / top-3 trees (every path over each slot's
best 2 or 3: a ceiling); a static tree of the N - 1 paths most often right on these very
sequences (in-sample, so optimistic); and qfd's dynamic tree (qfd.tree.build_tree: the
best-scoring paths of each step's own drafter scores) per size N and width W. Acceptance
only: no timing (bench_e2e.py --trees times the served trees).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ranks_and_scores(drafter, frozen, sequences, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: ranks [anchors, B-1] of the next token at each slot (huge where invalid)
    and the drafter's top-`width` log-probabilities [anchors, B-1, width]."""
    from qfd.drafter_trainer import block_passes

    parts = [(seq, torch.arange(seq.prompt_len, seq.ids.numel() - 1)) for seq in sequences]
    ranks, scores = [], []
    with torch.no_grad():
        for hidden, labels, valid in block_passes(drafter, frozen, parts, pack_tokens=4096):
            logits = frozen.head(hidden).float()
            label_logit = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1))
            rank = (logits > label_logit).sum(-1)
            rank[~valid] = torch.iinfo(rank.dtype).max
            ranks.append(rank.cpu())
            scores.append(logits.log_softmax(-1).topk(width, dim=-1).values.cpu())
    flat_r, flat_s = torch.cat(ranks), torch.cat(scores)
    out, start = [], 0
    for _, anchors in parts:  # block_passes keeps the parts' order
        out.append((flat_r[start : start + anchors.numel()], flat_s[start : start + anchors.numel()]))
        start += anchors.numel()
    return out


def replay(seqs, accepted_at) -> float:
    """tau of the walk where the step at anchor a keeps accepted_at(seq, a) drafts."""
    steps = []
    for seq in seqs:
        a = 0
        while a < seq[0].shape[0]:
            n = accepted_at(seq, a)
            steps.append(n + 1)
            a += n + 1
    return sum(steps) / max(1, len(steps))


def walk_ranks(parents, ranks, depths, label_ranks) -> int:
    """Drafts kept when the target's tokens have these candidate ranks per slot."""
    node, kept = 0, 0
    while kept < len(label_ranks):
        nxt = [c for c in range(len(parents)) if parents[c] == node and depths[c] == kept + 1 and ranks[c] == int(label_ranks[kept])]
        if not nxt:
            return kept
        node, kept = nxt[0], kept + 1
    return kept


def static_tree(seqs, size: int, max_rank: int = 8) -> set[tuple[int, ...]]:
    """The size - 1 rank paths most often right over all anchors (closed under prefixes)."""
    counts: Counter = Counter()
    for ranks, _ in seqs:
        for row in ranks.tolist():
            path: tuple[int, ...] = ()
            for r in row:
                if r >= max_rank:
                    break
                path += (r,)
                counts[path] += 1
    tree: set[tuple[int, ...]] = set()
    for path, _ in sorted(counts.items(), key=lambda item: (-item[1], len(item[0]))):
        if len(tree) >= size - 1:
            break
        if len(path) == 1 or path[:-1] in tree:
            tree.add(path)
    return tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, type=Path)
    p.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl")
    p.add_argument("--num", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--sizes", default="16,32,64")
    p.add_argument("--widths", default="4,8")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("tree_tau.json"))
    args = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    from qfd.checkpoint import resolve_model
    from qfd.drafter_trainer import FrozenTarget, TrainSequence
    from qfd.engine import Engine, GenerationConfig
    from qfd.models.drafter_io import load_drafter
    from qfd.models.hf import load_hf_causal_lm
    from qfd.models.loading import load_target
    from qfd.tree import build_tree

    sizes = [int(s) for s in args.sizes.split(",") if s]
    widths = [int(w) for w in args.widths.split(",") if w]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_dir = resolve_model(args.target).path
    target, tokenizer = load_target(target_dir, device, dtype)
    drafter = load_drafter(args.drafter, device=device, dtype=dtype)
    engine = Engine(target, tokenizer, max_len=2048)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][: args.num]
    sequences = []
    for row in rows:
        ids = engine.encode([{"role": "user", "content": row["question"]}])
        out = engine.generate(ids, GenerationConfig(max_new_tokens=args.max_new_tokens)).tokens
        sequences.append(TrainSequence(torch.tensor(ids + out), len(ids)))
    del engine
    frozen = FrozenTarget(load_hf_causal_lm(target_dir, device=device, dtype=dtype), drafter.cfg.target_layer_ids)
    seqs = ranks_and_scores(drafter, frozen, sequences, max(widths + [3]))
    depth = drafter.block_size - 1

    def leading(seq, a, ok) -> int:
        return int(torch.cumprod(ok(seq[0][a]).long(), 0).sum())

    result = {"sequences": len(sequences), "anchors": sum(s[0].shape[0] for s in seqs), "block_size": drafter.block_size, "rows": {}}
    result["rows"]["chain (k = B-1)"] = replay(seqs, lambda s, a: leading(s, a, lambda r: r == 0))
    for k in (2, 3):
        result["rows"][f"every path over the top {k} (ceiling)"] = replay(seqs, lambda s, a, k=k: leading(s, a, lambda r: r < k))
    for n in sizes:
        tree = static_tree(seqs, n)
        result["rows"][f"static tree {n} (in-sample)"] = replay(seqs, lambda s, a, tree=tree: next((d for d in range(depth) if tuple(s[0][a][: d + 1].tolist()) not in tree), depth))
    for w in widths:
        for n in sizes:
            def dynamic(s, a, n=n, w=w):
                t = build_tree(0, torch.arange(w).expand(depth, w), s[1][a][:, :w], n)
                return walk_ranks(t.parents, t.ranks, t.depths, s[0][a])
            result["rows"][f"dynamic tree {n}, top {w} per slot"] = replay(seqs, dynamic)

    table = Table(title=f"tau replayed on {result['sequences']} GSM8K test outputs ({result['anchors']} anchors), {args.drafter.name}")
    table.add_column("verification")
    table.add_column("tau", justify="right")
    for name, tau in result["rows"].items():
        table.add_row(name, f"{tau:.3f}")
    Console().print(table)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
