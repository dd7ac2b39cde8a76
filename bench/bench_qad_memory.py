"""QAD memory plan for the real target (issue 3, item 4): a random-weight Qwen3.5-4B-shaped
model as INT4 fake-quant student (fp32 latents, AdamW, gradient checkpointing, chunked KL)
plus a bf16 teacher on ONE GPU; a few QAD steps; peak memory and tokens/s.

    python bench/bench_qad_memory.py                     # 4B shape, CUDA (the lead runs it on the H200)
    python bench/bench_qad_memory.py --shape tiny --device cpu --steps 2 --seq-len 64   # smoke test

Writes a rich table and JSON (--json, default bench/results/qad_memory.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

QWEN35_4B = dict(
    vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, tie_word_embeddings=True, partial_rotary_factor=0.25,
)
TINY = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, tie_word_embeddings=True, partial_rotary_factor=0.25,
)


def build_config(shape: str):
    from transformers import Qwen3_5TextConfig

    sizes = dict(QWEN35_4B if shape == "4b" else TINY)
    layers = sizes["num_hidden_layers"]
    pattern = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return Qwen3_5TextConfig(layer_types=(pattern * (layers // 4 + 1))[:layers], max_position_embeddings=32768, **sizes)


def gib(n: int) -> float:
    return n / 2**30


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from qfd.qad_trainer import Evaluator, QadTrainer, TrainSettings, attach_fake_quant
    from qfd.quant.calibrate import quantizable_linears
    from qfd.quant.grid import dequantize, rtn_quantize

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    config = build_config(args.shape)
    teacher_dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device(device):
        teacher = AutoModelForCausalLM.from_config(config, dtype=teacher_dtype).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    # INT4 grid of the teacher's linears (RTN, symmetric, bf16 scales as compressed-tensors keeps)
    qweights = {name: rtn_quantize(m.weight.detach(), args.group_size, scale_dtype=torch.bfloat16) for name, m in quantizable_linears(teacher).items()}
    with torch.device(device):
        student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        student.load_state_dict({k: v.to(torch.float32) for k, v in teacher.state_dict().items()}, strict=False)
        for name, qw in qweights.items():
            student.get_submodule(name).weight.copy_(dequantize(qw))
    latents = attach_fake_quant(student, qweights)
    del qweights
    student.config.use_cache = False
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = torch.randint(0, config.vocab_size, (max(4, args.batch_size * args.grad_accum), args.seq_len))
    autocast = torch.bfloat16 if cuda else None
    evaluator = Evaluator(teacher, blocks[:1], device, args.kl_chunk, autocast)
    settings = TrainSettings(steps=args.steps, lr=2e-6, batch_size=args.batch_size, grad_accum=args.grad_accum, kl_chunk=args.kl_chunk, eval_every=0, save_every=10**9, autocast_dtype=autocast)
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    trainer = QadTrainer(student, teacher, latents, blocks, evaluator, settings, state, device)
    if cuda:
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, kls = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        kls.append(trainer.train_step())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    tokens = args.batch_size * args.grad_accum * args.seq_len
    steady = times[1:] or times
    result = {
        "shape": args.shape, "device": str(device), "seq_len": args.seq_len, "batch_size": args.batch_size, "grad_accum": args.grad_accum,
        "group_size": args.group_size, "kl_chunk": args.kl_chunk, "steps": args.steps,
        "params": sum(p.numel() for p in student.parameters()), "latent_params": sum(p.numel() for p in latents.values()),
        "step_s": sum(steady) / len(steady), "tokens_per_s": tokens / (sum(steady) / len(steady)), "kl": kls,
    }
    if cuda:
        result.update({"static_gib": gib(static), "peak_gib": gib(torch.cuda.max_memory_allocated()), "peak_reserved_gib": gib(torch.cuda.max_memory_reserved()), "gpu": torch.cuda.get_device_name(device)})
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("4b", "tiny"), default="4b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--kl-chunk", type=int, default=1024)
    parser.add_argument("--state-dir", default="/tmp/qfd-bench-qad-state")
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "qad_memory.json"))
    args = parser.parse_args(argv)
    result = run(args)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"QAD memory / speed, Qwen3.5-{args.shape} shape")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, ", ".join(f"{v:.4g}" for v in value) if isinstance(value, list) else f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
