"""CPU step costs against the draft length k, and the acceptance speculative decoding needs to
beat target-only decoding there. CPU numbers: on a GPU a 16-token verify costs about a decode
step; on a CPU a (k+1)-token verify costs more than a decode step (embedded model, 2 cores:
1.3-1.9x with F.linear, not monotone in k as MKL picks its small-M GEMM kernels by shape; with
qfd.models.linear's W @ x.T path for <= 8 rows, decode is 1.8x cheaper and a 2-5-token verify
costs 1.0-1.5 decode steps, 7-16 tokens 2-3), so the drafts must be accepted often enough to
pay for the verify and the draft.

On the embedded SmolLM2-135M (or --target) with a randomly initialised DFlash drafter built for
it (or --drafter DIR), eager fp32 as the engine runs on a CPU, torch threads = --threads,
after a prefill of --context tokens, median milliseconds of:

    decode     the target's 1-token forward (a target-only step)
    verify_k   the target's (k+1)-token forward with the drafter's taps (a spec step's verify)
    draft_k    drafter.draft(num_drafts=k): the B-token block forward + the LM head over k slots
    append_k   drafter.append_context of k+1 tokens (the most one step commits)

and the break-even acceptance: with draft length k, speculative decoding is faster than
target-only when tau_k (committed tokens per step, bonus included, at most k+1) exceeds
(draft_k + verify_k) / decode, or (draft_k + verify_k + append_k) / decode counting the
drafter's context update too. Random weights give exact costs, not acceptance. The timings
are interleaved (one round of every measurement at a time), so drift and other load on the box
spread evenly over the rows.

--small-rows N[,N...] measures the steps under each qfd.models.linear.SMALL_ROWS threshold
(linears with at most N float32 rows on the CPU compute W @ x.T, MKL's faster kernel for few
rows; 0 = F.linear everywhere, as before that path), interleaved within each round; the JSON
then holds one entry of "runs" per threshold. Default: the library's threshold only.

--draft-vocab N[,N...] measures draft_k with the drafter's LM head over only the N most frequent
ids (qfd.draft_vocab, Engine(draft_vocab=N); 0 = the full head), interleaved like the rest; one
entry of "runs" per (threshold, N). The ids come from the --drafter's draft_vocab.safetensors
when it has one, else from the target tokenizing GSM8K train answers (../shared/data), else
the first N ids: a step's cost depends on N, not on which ids (the output says which source).

    python bench/bench_cpu_draft_len.py [--target smollm2-135m] [--drafter DIR] [--layers 5]
        [--context 256] [--lens 1,2,3,4,6,8,15] [--threads 2] [--iters 30] [--small-rows 0,8]
        [--draft-vocab 0,8192] [--out cpu_draft_len.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def vocab_counts(drafter, tokenizer, vocab: int) -> tuple[torch.Tensor, str]:
    """Token counts for --draft-vocab: the drafter's own, else GSM8K train answers tokenized by
    the target, else none (zeros: top_ids then gives the first N ids)."""
    counts = getattr(drafter, "draft_vocab_counts", None)
    if counts is not None:
        return counts, "the drafter's draft_vocab.safetensors"
    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
    if tokenizer is not None and path.is_file():
        answers = [json.loads(line)["answer"] for line in path.read_text().splitlines() if line.strip()]
        from qfd.draft_vocab import count_tokens

        records = [{"response_ids": ids} for ids in tokenizer(answers)["input_ids"]]
        return count_tokens(records, vocab, source=str(path)), f"GSM8K train answers ({len(answers)}) tokenized by the target"
    return torch.zeros(vocab, dtype=torch.int64), "the first N ids (no counts found; the cost does not depend on which ids)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target model (default: the embedded SmolLM2-135M)")
    p.add_argument("--drafter", type=Path, default=None, help="a drafter directory (default: a random one built for the target)")
    p.add_argument("--layers", type=int, default=5, help="layers of the random drafter (qfd draft train's default: 5; the demo preset: 2)")
    p.add_argument("--block-size", type=int, default=16, help="block size B of the random drafter")
    p.add_argument("--context", type=int, default=256, help="tokens already in the caches when the steps run")
    p.add_argument("--lens", default="1,2,3,4,6,8,15", help="draft lengths k to measure (each <= B-1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=30, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--small-rows", default=None, help="comma-separated qfd.models.linear.SMALL_ROWS thresholds to compare, interleaved (0: F.linear everywhere); default: the library's")
    p.add_argument("--draft-vocab", default=None, help="comma-separated draft vocabulary sizes N for the drafter's LM head (0: the full head), interleaved; default: 0")
    p.add_argument("--out", type=Path, default=Path("cpu_draft_len.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from qfd.models import linear as qfd_linear

    settings = [int(n) for n in args.small_rows.split(",") if n] if args.small_rows else [qfd_linear.SMALL_ROWS]
    vocabs = [int(v) for v in args.draft_vocab.split(",") if v] if args.draft_vocab else [0]

    from qfd.checkpoint import read_json, resolve_model
    from qfd.models.drafter import DFlashDrafter, config_for_target, load_drafter
    from qfd.models.loading import load_target

    model_dir = resolve_model(args.target)
    target, tokenizer = load_target(model_dir, "cpu", torch.float32)
    if args.drafter is not None:
        drafter = load_drafter(args.drafter, "cpu", torch.float32, fuse=True)
    else:
        torch.manual_seed(0)
        cfg = config_for_target(read_json(model_dir.path / "config.json"), tokenizer, num_layers=args.layers, block_size=args.block_size)
        drafter = DFlashDrafter(cfg).eval()
    B = drafter.block_size
    lens = [int(k) for k in args.lens.split(",") if k]
    if any(not 1 <= k <= B - 1 for k in lens):
        p.error(f"--lens must lie in 1..{B - 1} for a block size of {B}")
    taps = tuple(drafter.cfg.target_layer_ids)
    vocab = target.config.vocab_size
    L = args.context
    if any(not 0 <= v <= vocab for v in vocabs):
        p.error(f"--draft-vocab sizes must lie in 0..{vocab} (0: the full head)")
    heads, vocab_source = {0: target.head}, None
    if any(vocabs):
        from qfd.draft_vocab import DraftVocabHead, top_ids

        counts, vocab_source = vocab_counts(drafter, tokenizer, vocab)
        print(f"draft vocabulary ids: {vocab_source}")
        heads.update({v: DraftVocabHead.of_target(target, top_ids(counts, v)) for v in vocabs if v})

    # The engine's caches (dynamic attention over the filled prefix, as Engine builds them on a
    # CPU), holding L tokens. Every target step below runs at position L and rolls back to L.
    cache = target.new_cache(L + B + 1, max_verify=16)
    dcache = drafter.new_cache(L + B + 1)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        out = target(torch.randint(3, vocab, (1, L), generator=g), cache, tap_layers=taps, last_only=True)
        drafter.append_context(dcache, out.taps, 0)
    blocks = {k: torch.randint(3, vocab, (1, k + 1), generator=g) for k in lens}
    new_taps = torch.randn(1, B, out.taps.shape[-1], generator=g)

    def decode():
        target(blocks[lens[0]][:, :1], cache)
        cache.rollback(L)

    def verify(k):
        def run():
            target(blocks[k], cache, tap_layers=taps)
            cache.rollback(L)
        return run

    def draft(k):  # the drafter's LM head: `heads[v]` (v = 0: the target's full head)
        return lambda v: drafter.draft(dcache, 5, L, embed=target.embed, head=heads[v], num_drafts=k)

    def append(k):
        return lambda: drafter.append_context(dcache, new_taps[:, : k + 1], L)  # overwrites L.., leaves positions < L

    fns = {"decode": decode}
    for k in lens:
        fns[f"verify_{k}"], fns[f"draft_{k}"], fns[f"append_{k}"] = verify(k), draft(k), append(k)
    # (threshold, draft vocabulary, step) -> times; only draft_k depends on the vocabulary
    per_vocab = lambda name: vocabs if name.startswith("draft_") else vocabs[:1]  # noqa: E731
    times: dict[tuple[int, int, str], list[float]] = {(n, v, name): [] for n in settings for name in fns for v in per_vocab(name)}
    with torch.inference_mode():
        for round_ in range(args.warmup + args.iters):
            for name, fn in fns.items():
                for n in settings:
                    qfd_linear.SMALL_ROWS = n
                    for v in per_vocab(name):
                        t0 = time.perf_counter()
                        fn(v) if name.startswith("draft_") else fn()
                        if round_ >= args.warmup:
                            times[(n, v, name)].append((time.perf_counter() - t0) * 1e3)
    runs = []
    for n, v in [(n, v) for n in settings for v in vocabs]:
        ms = {name: statistics.median(times[(n, v if name.startswith("draft_") else vocabs[0], name)]) for name in fns}
        decode_ms = ms["decode"]
        rows = []
        for k in lens:
            step = ms[f"draft_{k}"] + ms[f"verify_{k}"]
            rows.append({"k": k, "verify_ms": ms[f"verify_{k}"], "draft_ms": ms[f"draft_{k}"], "append_ms": ms[f"append_{k}"],
                         "verify_over_decode": ms[f"verify_{k}"] / decode_ms, "break_even_tau": step / decode_ms,
                         "break_even_tau_with_append": (step + ms[f"append_{k}"]) / decode_ms, "max_tau": k + 1})
        runs.append({"small_rows": n, "draft_vocab": v, "decode_ms": decode_ms, "rows": rows})
    drafter_desc = str(args.drafter) if args.drafter else f"random, {drafter.cfg.num_hidden_layers} layers"
    results = {"device": "cpu", "cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__, "target": args.target,
               "drafter": drafter_desc, "block_size": B, "context": L, "iters": args.iters, "draft_vocab_source": vocab_source, "command": " ".join(["python", *sys.argv])}
    results.update(runs[0] if len(runs) == 1 else {"runs": runs})
    args.out.write_text(json.dumps(results, indent=2) + "\n")

    from rich.console import Console
    from rich.table import Table

    console = Console()
    for run in runs:
        table = Table(title=f"CPU step costs vs draft length k: {args.target} + drafter ({drafter_desc}, B={B}), context {L}, {args.threads} threads, {cpu_name()}, "
                      f"linear small rows <= {run['small_rows']}, drafter head over {run['draft_vocab'] or 'all'} ids; target decode {run['decode_ms']:.2f} ms")
        for col in ("k", "verify k+1 ms", "verify/decode", "draft(k) ms", "append ms", "break-even tau", "(with append)", "max tau k+1"):
            table.add_column(col, justify="right")
        for r in run["rows"]:
            table.add_row(str(r["k"]), f"{r['verify_ms']:.2f}", f"{r['verify_over_decode']:.2f}", f"{r['draft_ms']:.2f}", f"{r['append_ms']:.2f}",
                          f"{r['break_even_tau']:.2f}", f"{r['break_even_tau_with_append']:.2f}", str(r["max_tau"]))
        console.print(table)
    if len(vocabs) > 1:
        table = Table(title=f"draft(k) ms by draft vocabulary size N (0 = full head, {vocab} ids); ids from {vocab_source}")
        table.add_column("small rows", justify="right")
        table.add_column("k", justify="right")
        for v in vocabs:
            table.add_column(f"N={v} ms" + (" (x full)" if 0 in vocabs else "") if v else "full head ms", justify="right")
        for n in settings:
            by_vocab = {r["draft_vocab"]: {row["k"]: row["draft_ms"] for row in r["rows"]} for r in runs if r["small_rows"] == n}
            for k in lens:
                ms_of = lambda v: by_vocab[v][k]  # noqa: E731
                cells = [f"{ms_of(v):.2f}" + (f" ({ms_of(v) / ms_of(0):.2f})" if v and 0 in vocabs else "") for v in vocabs]
                table.add_row(str(n), str(k), *cells)
        console.print(table)
    console.print("spec with draft length k beats target-only when tau_k > (draft_k + verify_k) / decode; a break-even above k+1 cannot be reached")
    console.print(f"written: {args.out}")


if __name__ == "__main__":
    main()
