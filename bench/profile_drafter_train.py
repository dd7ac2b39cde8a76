"""Where a drafter training step spends its time: a random-weight target built from a config
(step costs do not depend on the weights), synthetic sequences of a given prompt/response
length, and the trainer's own functions timed piece by piece (taps; drafter forward; forward +
chunked CE + backward; optimizer), then a torch.profiler table of the top ops.

    python bench/profile_drafter_train.py --config ~/.cache/qfd/models/smollm2-135m/config.json \
        --device cuda --out bench/results/profile_drafter_train.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _timed(fn, sync, repeats: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the target's config.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=180)
    ap.add_argument("--response-len", type=int, default=190)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--pack", type=int, default=8, help="sequences per packed micro-batch (the packed variant)")
    ap.add_argument("--max-cells", type=int, default=800_000, help="blocks x context cells per drafter pass")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from qfd.drafter_losses import slot_weights
    from qfd.drafter_trainer import FrozenTarget, TrainSequence, packed_loss_backward, sample_anchors, sequence_loss
    from qfd.models.drafter import DFlashDrafter, config_for_target

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(str(Path(args.config).expanduser().parent))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    target = FrozenTarget(model, ())
    drafter_cfg = config_for_target(json.loads(Path(args.config).expanduser().read_text()), mask_token_id=0)
    target.tap_layers = drafter_cfg.target_layer_ids
    drafter = DFlashDrafter(drafter_cfg).to(device=device, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=device.type == "cuda")
    weights = slot_weights(drafter.block_size)
    t = args.prompt_len + args.response_len
    gen = torch.Generator().manual_seed(0)
    seqs = [TrainSequence(torch.randint(0, config.vocab_size, (t,), generator=gen), args.prompt_len) for _ in range(args.pack)]
    anchors = [sample_anchors(s.prompt_len, t, args.anchors, gen) for s in seqs]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids0 = seqs[0].ids.to(device)
    anchors0 = anchors[0].to(device)

    def taps():
        target.taps(ids0)

    def forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            drafter.forward_train(target.taps(ids0), ids0, anchors0, target.embed)

    def one_sequence():
        loss, _ = sequence_loss(drafter, target, seqs[0], anchors[0], weights)
        loss.backward()

    def per_sequence_step():
        for s, a in zip(seqs, anchors):
            loss, _ = sequence_loss(drafter, target, s, a, weights)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def packed_step():
        packed_loss_backward(drafter, target, list(zip(seqs, anchors)), weights, 1.0, 1 << 30, args.max_cells)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rows = {
        "taps (1 seq)": _timed(taps, sync, args.repeats),
        "drafter forward, no grad (1 seq)": _timed(forward, sync, args.repeats),
        "fwd + CE + bwd (1 seq)": _timed(one_sequence, sync, args.repeats),
        f"step, {args.pack} seqs one by one": _timed(per_sequence_step, sync, args.repeats),
        f"step, {args.pack} seqs packed": _timed(packed_step, sync, args.repeats),
    }
    n_anchor = int(anchors[0].numel())
    print(f"target {config.model_type} hidden {config.hidden_size} x {config.num_hidden_layers} layers; sequence {args.prompt_len}+{args.response_len} tokens, {n_anchor} anchors; device {device}")
    for name, ms in rows.items():
        print(f"{name:40s} {ms:9.2f} ms")
    per_seq = rows[f"step, {args.pack} seqs one by one"] / args.pack
    packed = rows[f"step, {args.pack} seqs packed"] / args.pack
    print(f"sequences/s: one by one {1000 / per_seq:.1f}, packed {1000 / packed:.1f} ({per_seq / packed:.2f}x)")

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:  # the packed step: the trainer's path
        packed_step()
        sync()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=18)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows_ms": rows, "anchors": n_anchor, "pack": args.pack, "sequence_tokens": t, "device": str(device), "profile_table": table}, indent=2))


if __name__ == "__main__":
    main()
