"""`qfd qad`: quantization-aware distillation on the checkpoint's own INT4 grid (method.md 1).

validate (INT4 ckpt, supported scheme, teacher matches, enough data) -> load teacher + student
-> step-0 sanity (fake-quant student KL == the INT4 checkpoint's own KL) -> train (resumable)
-> repack codes onto the SAME scales/zeros, same format -> verify -> held-out KL/ppl of the
written checkpoint -> manifest. Under torchrun every rank runs this recipe: rank 0 prepares
the data, runs the sanity check and evaluations and writes; all ranks train data-parallel
(qfd.distributed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qfd.errors import QfdError

TEACHER_ROLES = ("teacher", "model", "source")


@dataclass(frozen=True)
class QadConfig:
    ckpt: Path
    out: Path
    teacher: str | None = None
    data: str | None = None
    generate_from: str | None = None
    generate_samples: int = 256
    generate_tokens: int = 256
    steps: int = 200
    lr: float = 1e-5
    seq_len: int = 256
    batch_size: int = 4
    grad_accum: int = 1
    eval_every: int = 50
    eval_blocks: int = 8
    kl_chunk: int = 1024
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    overwrite: bool = False
    sanity_rtol: float | None = None  # None: 1e-3 in fp32, 3e-2 otherwise


def default_teacher(ckpt_dir: Path) -> str:
    """The BF16 model an INT4 checkpoint was made from, from its qfd manifest lineage."""
    from qfd.manifest import read_manifest

    manifest = read_manifest(ckpt_dir) or {}
    parents = {p.get("role"): p for p in manifest.get("parents", [])}
    for role in TEACHER_ROLES:
        if role in parents and Path(parents[role]["path"]).is_dir():
            return parents[role]["path"]
    raise QfdError(f"{ckpt_dir} does not record its BF16 parent; pass --teacher BF16DIR")


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def check_teacher(student_config: dict[str, Any], teacher_config: dict[str, Any], teacher_path: Path) -> None:
    s, t = _text_config(student_config), _text_config(teacher_config)
    if s.get("vocab_size") != t.get("vocab_size"):
        raise QfdError(f"teacher {teacher_path} has vocabulary {t.get('vocab_size')}, the student {s.get('vocab_size')}: pass the BF16 model this INT4 checkpoint was made from")
    for key in ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size"):
        if s.get(key) != t.get(key):
            raise QfdError(f"teacher {teacher_path} differs from the student in {key} ({t.get(key)} vs {s.get(key)}): pass the BF16 model this INT4 checkpoint was made from")


def validate(cfg: QadConfig):
    """All user mistakes, before any long work. Returns (student ModelDir, teacher ModelDir)."""
    from qfd.checkpoint import inspect_model_dir, resolve_model
    from qfd.quant.formats import format_scheme

    for name, value in (("--steps", cfg.steps), ("--batch-size", cfg.batch_size), ("--grad-accum", cfg.grad_accum), ("--seq-len", cfg.seq_len), ("--eval-blocks", cfg.eval_blocks)):
        if value < 1:
            raise QfdError(f"{name} must be at least 1")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise QfdError("--lr must be a positive number")
    if cfg.data and cfg.generate_from:
        raise QfdError("give either --data or --generate-from, not both")
    student = inspect_model_dir(Path(cfg.ckpt))
    if not student.is_quantized:
        raise QfdError(f"--ckpt {student.path} is not an INT4 checkpoint (no quantization_config): make one with `qfd quantize --model {student.path} --out DIR`")
    format_scheme(student.config)  # unsupported bits / group size / method -> QfdError
    teacher = resolve_model(cfg.teacher if cfg.teacher else default_teacher(student.path))
    if teacher.is_quantized:
        raise QfdError(f"--teacher {teacher.path} is quantized; the teacher is the BF16 model")
    check_teacher(student.config, teacher.config, teacher.path)
    return student, teacher


def _documents(cfg: QadConfig, teacher_model, tokenizer, state_dir: Path):
    from qfd.qad_data import load_documents

    if cfg.data:
        return load_documents(cfg.data, tokenizer), {"data": cfg.data}
    from qfd.data import generate_responses, load_prompts

    prompts = load_prompts(cfg.generate_from, limit=cfg.generate_samples)
    records = generate_responses(teacher_model, tokenizer, prompts, max_new_tokens=cfg.generate_tokens, out_path=state_dir / "generated.jsonl", seed=cfg.seed)
    return [r["prompt_ids"] + r["response_ids"] for r in records], {"generated_from": cfg.generate_from or "gsm8k-train (default)", "generated_records": len(records)}


def run(cfg: QadConfig) -> tuple[Path, dict]:
    student_dir, teacher_dir = validate(cfg)
    import torch

    from qfd.checkpoint import Staging, copy_tokenizer_files, inspect_model_dir
    from qfd.console import console, progress_bar
    from qfd.device import pick_device, pick_dtype
    from qfd.distributed import init_from_env
    from qfd.models.hf import load_hf_causal_lm, load_hf_int4_runtime, load_tokenizer
    from qfd.qad_data import split_blocks
    from qfd.qad_trainer import Evaluator, QadTrainer, TrainSettings, attach_fake_quant, repack_codes
    from qfd.quant.formats import load_quantized, save_quantized

    dist = init_from_env(pick_device(cfg.device))  # single process unless run under torchrun
    device = dist.device
    # Rank 0 alone touches the output directory; the others get a copy of its Staging (paths).
    staging = dist.on_main(lambda: Staging(cfg.out, overwrite=cfg.overwrite))
    state_dir = dist.on_main(staging.state_dir)  # made by rank 0
    dtype = pick_dtype(cfg.dtype, device)
    autocast = None if dtype == torch.float32 else dtype
    tokenizer = load_tokenizer(teacher_dir)
    teacher = load_hf_causal_lm(teacher_dir, device, dtype)
    for p in teacher.parameters():
        p.requires_grad_(False)

    docs, data_info = dist.on_main(lambda: _documents(cfg, teacher, tokenizer, state_dir))
    train_blocks, eval_blocks = split_blocks(docs, cfg.seq_len, tokenizer.eos_token_id, max_eval_blocks=cfg.eval_blocks)
    need = cfg.batch_size
    if train_blocks.shape[0] < need or eval_blocks.shape[0] < 1:
        raise QfdError(f"training data too short: {train_blocks.shape[0]} train blocks of {cfg.seq_len} tokens (need {need}) and {eval_blocks.shape[0]} held-out; give more text or a smaller --seq-len/--batch-size")

    ckpt = load_quantized(student_dir.path)
    evaluator = Evaluator(teacher, eval_blocks, device, cfg.kl_chunk, autocast) if dist.is_main else None  # rank 0 evaluates

    # Step-0 sanity: the INT4 checkpoint itself (Int4Linear kernels) vs the fake-quant student.
    before = dist.on_main(lambda: evaluator(load_hf_int4_runtime(student_dir, device, dtype, ckpt=ckpt)))
    student = load_hf_causal_lm(student_dir, device, torch.float32, ckpt=ckpt)
    latents = attach_fake_quant(student, ckpt.qweights)
    student.config.use_cache = False
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def sanity() -> dict:
        student_before = evaluator(student)
        rtol = cfg.sanity_rtol if cfg.sanity_rtol is not None else (1e-3 if dtype == torch.float32 else 3e-2)
        gap = abs(student_before["kl"] - before["kl"])
        if gap > rtol * max(before["kl"], 1e-6) + 1e-6:
            raise RuntimeError(f"step-0 sanity check failed: fake-quant student KL {student_before['kl']:.6g} != INT4 checkpoint KL {before['kl']:.6g}")
        console.print(f"[dim]step 0: INT4 KL {before['kl']:.5f} ppl {before['ppl']:.3f}; fake-quant student KL {student_before['kl']:.5f} (sanity ok)[/dim]")
        return student_before

    student_before = dist.on_main(sanity)

    settings = TrainSettings(steps=cfg.steps, lr=cfg.lr, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, kl_chunk=cfg.kl_chunk, eval_every=cfg.eval_every, seed=cfg.seed, autocast_dtype=autocast)
    trainer = QadTrainer(student, teacher, latents, train_blocks, evaluator, settings, state_dir, device, dist=dist)
    if trainer.load_state():
        console.print(f"[dim]resuming QAD at step {trainer.step}/{cfg.steps} from {state_dir}[/dim]")
    with progress_bar() as bar:
        task = bar.add_task("qad", total=cfg.steps, completed=trainer.step)
        last_eval: dict = {}

        def on_step(step, kl, evaluated):
            if evaluated:
                last_eval.update(evaluated)
            extra = f" eval_kl={last_eval['kl']:.4f}" if last_eval else ""
            bar.update(task, completed=step, postfix=f"kl={kl:.4f}{extra}")

        history = trainer.run(on_step)

    # Output: codes rounded onto the SAME scale/zero tensors, in the input's format.
    new_qweights = repack_codes(student, ckpt.qweights) if dist.is_main else None
    del student, trainer

    def finish() -> tuple[Path, dict]:  # rank 0: write, verify, evaluate, manifest
        save_quantized(staging.path, ckpt, new_qweights)
        copy_tokenizer_files(student_dir.path, staging.path)
        changed = verify_grid(ckpt, load_quantized(staging.path))
        after = evaluator(load_hf_int4_runtime(inspect_model_dir(staging.path), device, dtype))
        metrics = {
            "kl_before": before["kl"], "kl_after": after["kl"],
            "kl_reduction": 1.0 - after["kl"] / before["kl"] if before["kl"] > 0 else 0.0,
            "ppl_before": before["ppl"], "ppl_after": after["ppl"], "teacher_ppl": evaluator(teacher)["ppl"],
            "sanity_student_kl": student_before["kl"], "sanity_int4_kl": before["kl"], "sanity_passed": True,
            "codes_changed": changed, "train_blocks": int(train_blocks.shape[0]), "eval_blocks": int(eval_blocks.shape[0]),
            "format": ckpt.format, "history": history, **data_info,
        }
        config = {**asdict(cfg), "ckpt": str(cfg.ckpt), "out": str(cfg.out), "teacher": str(teacher_dir.path), "device": str(device), "dtype": str(dtype).replace("torch.", "")}
        out = staging.commit(stage="qad", parents={"student_init": student_dir.path, "teacher": teacher_dir.path}, config=config, metrics=metrics)
        return out, metrics

    return dist.on_main(finish)


def verify_grid(before, after) -> int:
    """Every scale / zero point bitwise equal and codes in range; returns how many codes changed."""
    from qfd.quant.grid import qrange

    changed = 0
    for path, old in before.qweights.items():
        new = after.qweights[path]
        same_scales = bitwise_equal(old.scales, new.scales)
        same_zeros = (old.zeros is None and new.zeros is None) or (old.zeros is not None and new.zeros is not None and bitwise_equal(old.zeros, new.zeros))
        if not (same_scales and same_zeros):
            raise RuntimeError(f"QAD output changed the grid of {path}: scales/zeros must be bitwise identical")
        qmin, qmax = qrange(new.bits, True) if new.zeros is None else (0, 15)
        if int(new.codes.min()) < qmin or int(new.codes.max()) > qmax:
            raise RuntimeError(f"QAD output codes of {path} out of range")
        changed += int((old.codes != new.codes).sum())
    return changed


def bitwise_equal(a, b) -> bool:
    """Same dtype, shape and bytes."""
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
