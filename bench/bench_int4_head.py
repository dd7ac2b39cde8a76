"""What `--int4-head` costs in quality: the target with its LM head in INT4 (RTN symmetric,
group 128 or the fallback `qfd.quant.head.head_group_size` picks) against the same target with its dense head, on held-out GSM8K
test prompts (chat template), CPU or GPU.

    python bench/bench_int4_head.py [--target smollm2-135m] [--prompts test.jsonl] [--num 16]
        [--max-new-tokens 64] [--device cpu|cuda] [--group-size 128|64|32] [--int8] [--out int4_head.json]

--int8: instead, the INT8 head `--int8-head` serves (qfd.quant.head.Int8Head, symmetric, the same
group size): what halving the head's bytes (rather than quartering them) costs in quality, the
same metrics. (A CPU computes it with its dequantized weights; CUDA runs the INT8 kernel.)

Method: load the target twice (float32 on a CPU, bf16 on CUDA), the second time with its head
quantized as `load_target(int4_head=True)` does (`quantize_head` after loading: group 128,
or 64 / 32 where 128 does not divide the width, e.g. SmolLM2-135M's 576 -> 64; --group-size
picks another). For each prompt the DENSE model greedily generates up to
--max-new-tokens tokens (qfd's Engine, target-only, stopping at the model's stop tokens);
then one teacher-forced forward of prompt + that continuation through each model, compared
at the positions that predict the continuation's tokens:
  - top-1 agreement: both heads' argmax is the same token,
  - KL(p_dense || p_int4) in nats, averaged over the positions,
  - the largest |logit difference| seen.
Free running: the INT4-head model's own greedy continuation against the dense one - the
fraction of prompts whose continuations are identical, and where the first differing token
sits (mean over the prompts that diverge).

This measures the HEAD only: both models share the body as loaded (a dense checkpoint stays
dense, an INT4 checkpoint keeps its INT4 body); the difference between them is the head's
weights moved to the INT4 grid. Speculative decoding with --int4-head stays lossless with
respect to the INT4-head model; these figures say how far that model is from the dense one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_e2e import prompts_from  # noqa: E402 (the same GSM8K reader as the e2e bench)


def greedy(target, tokenizer, prompt_ids: list[list[int]], max_new: int, eos_ids) -> list[list[int]]:
    """Target-only greedy continuations through qfd's Engine (a final stop token included)."""
    from qfd.engine import Engine, GenerationConfig

    engine = Engine(target, tokenizer, max_len=max(map(len, prompt_ids)) + max_new, eos_ids=eos_ids)
    config = GenerationConfig(max_new_tokens=max_new)
    return [engine.generate(ids, config).tokens for ids in prompt_ids]


@torch.inference_mode()
def continuation_logits(target, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[len(continuation), V] float32 logits of one teacher-forced forward over prompt +
    continuation, at the positions that predict the continuation's tokens."""
    device = target.model.embed_tokens.weight.device
    ids = torch.tensor([prompt + continuation], device=device)
    logits = target(ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(continuation) - 1].float()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target model: a directory, a hub id, or a built-in name (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl")
    p.add_argument("--num", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--group-size", type=int, choices=(128, 64, 32), default=None, help="default: 128 (what --int4-head uses) when it divides the head's width, else 64, else 32")
    p.add_argument("--int8", action="store_true", help="the INT8 head of --int8-head instead of --int4-head's INT4")
    p.add_argument("--out", type=Path, default=Path("bench_int4_head.json"))
    args = p.parse_args()

    from qfd.checkpoint import resolve_model
    from qfd.engine import Engine
    from qfd.models.loading import load_target, stop_token_ids
    from qfd.quant.head import GROUP_SIZE, head_group_size, quantize_head

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = resolve_model(args.target)
    start = time.perf_counter()
    dense, tokenizer = load_target(model_dir, device, dtype)
    width = dense.config.hidden_size
    group = args.group_size or head_group_size(width) or GROUP_SIZE
    int4, _ = load_target(model_dir, device, dtype, tokenizer=False)
    quantize_head(int4, group, bits=8 if args.int8 else 4)  # what load_target(int4_head / int8_head=True) does, at `group`
    eos_ids = stop_token_ids(model_dir, tokenizer)
    probe = Engine(dense, tokenizer, max_len=16)  # only its chat-template encoding
    prompt_ids = [probe.encode([{"role": "user", "content": q}]) for q in prompts_from(args.prompts, args.num)]
    del probe

    dense_out = greedy(dense, tokenizer, prompt_ids, args.max_new_tokens, eos_ids)
    agree, self_agree, positions, kl_sum, max_diff = 0, 0, 0, 0.0, 0.0
    for ids, cont in zip(prompt_ids, dense_out):
        a, b = continuation_logits(dense, ids, cont), continuation_logits(int4, ids, cont)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        self_agree += int((a.argmax(-1) == torch.tensor(cont, device=a.device)).sum())  # the harness's own check
        positions += a.shape[0]
        log_p, log_q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl_sum += float((log_p.exp() * (log_p - log_q)).sum())
        max_diff = max(max_diff, float((a - b).abs().max()))
    int4_out = greedy(int4, tokenizer, prompt_ids, args.max_new_tokens, eos_ids)
    divergences = [first_divergence(a, b) for a, b in zip(dense_out, int4_out)]
    diverged = [d for d in divergences if d is not None]

    head = dense.lm_head.weight
    metrics = {
        "top1_agreement": agree / positions,
        "kl_dense_int4_nats": kl_sum / positions,
        "max_abs_logit_diff": max_diff,
        "identical_continuations": (len(divergences) - len(diverged)) / len(divergences),
        "mean_first_divergence": sum(diverged) / len(diverged) if diverged else None,
        "dense_self_agreement": self_agree / positions,
    }
    results = {
        "target": str(model_dir.path), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype).removeprefix("torch."),
        "num": len(prompt_ids), "max_new_tokens": args.max_new_tokens, "head_shape": list(head.shape),
        "head_format": f"int{8 if args.int8 else 4} RTN symmetric g{group}", "group_size": group, "head_flag_group": group == head_group_size(width),
        "positions": positions, "prompt_tokens_mean": sum(map(len, prompt_ids)) / len(prompt_ids),
        "continuation_tokens_mean": positions / len(prompt_ids), "diverged_prompts": len(diverged),
        "first_divergences": divergences, "seconds": time.perf_counter() - start, "metrics": metrics,
    }
    args.out.write_text(json.dumps(results, indent=2))

    from rich.console import Console
    from rich.table import Table

    stand_in = "" if group == head_group_size(width) else f", not --int4-head's g{head_group_size(width)}"
    label = f"INT{8 if args.int8 else 4} LM head (RTN symmetric g{group}{stand_in})"
    table = Table(title=f"{label} vs dense head, {model_dir.path.name} (head {head.shape[0]}x{head.shape[1]}), {len(prompt_ids)} GSM8K test prompts (chat), "
                        f"{args.max_new_tokens} new tokens greedy by the dense model, teacher-forced through both; {results['device']} {results['dtype']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row(f"top-1 agreement ({positions} continuation positions)", f"{metrics['top1_agreement']:.4f}")
    quant = "INT8" if args.int8 else "INT4"
    table.add_row(f"mean KL(p_dense || p_{quant.lower()}), nats", f"{metrics['kl_dense_int4_nats']:.2e}")
    table.add_row("max |logit difference|", f"{metrics['max_abs_logit_diff']:.4f}")
    table.add_row(f"identical free-running greedy continuations ({quant}-head model's own vs dense, up to {args.max_new_tokens} tokens)", f"{metrics['identical_continuations']:.3f} ({len(divergences) - len(diverged)}/{len(divergences)})")
    first = metrics["mean_first_divergence"]
    table.add_row(f"mean position of the first differing token ({len(diverged)} diverging prompts)", "-" if first is None else f"{first:.1f}")
    table.add_row("check: dense teacher-forced argmax = its own greedy tokens (expect ~1)", f"{metrics['dense_self_agreement']:.4f}")
    Console().print(table)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
