"""`qfd draft quantize`: GPTQ INT4 of the DFlash drafter (method.md section 3).

Recipe: validate -> load target (transformers, for its tapped hidden states, embedding and
head) and drafter -> calibration conversations (target-generated: `--data`, else generated
here from GSM8K train prompts) -> target taps per conversation, computed once -> GPTQ of
every drafter linear (fusion fc first, then each decoder layer: sequential, each group
calibrated on the already-quantized earlier ones) with Hessians from REAL drafter block
forwards (`DFlashDrafter.forward_train`) at `anchors_per_sample` random anchors in each
response -> held-out expected acceptance length of the BF16, RTN and GPTQ drafters ->
save in a standard INT4 format (compressed-tensors pack-quantized, or GPTQ v1) with the
drafter's config.json (+ quantization_config) -> manifest with per-layer GPTQ vs RTN errors.

The INT4 drafter loads with `load_drafter_any` (here) / `qfd.quant.int4_load.load_int4_module`:
the drafter is built from config.json and its linears are swapped for Int4Linear.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from qfd.checkpoint import DRAFT_VOCAB_NAME, TOKENIZER_FILES, Staging, resolve_model
from qfd.errors import QfdError
from qfd.manifest import read_manifest
from qfd.stages.draft_swa import drafter_dir, prior_transforms

if TYPE_CHECKING:
    import torch

STAGE = "draft-quantize"
FORMATS = ("compressed-tensors", "gptq")


@dataclass(frozen=True)
class DraftQuantizeConfig:
    drafter: Path
    target: str
    out: Path
    group_size: int = 128
    samples: int = 256
    anchors_per_sample: int = 16
    data: Path | None = None
    max_length: int = 1024
    format: str = "compressed-tensors"
    backend: str = "gptqmodel"
    damp: float = 0.01
    sequential: bool = True
    eval_samples: int = 16  # held-out conversations for the acceptance-length check
    eval_anchors: int = 64
    gen_tokens: int = 192  # response length when generating calibration data here
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    overwrite: bool = False
    allow_target_mismatch: bool = False


@dataclass
class Conversation:
    """One calibration sequence: ids [T] and where the response starts."""

    input_ids: Any  # torch.LongTensor [T]
    response_start: int
    taps: Any = None  # [1, T, k*H] on CPU


# ---------------------------------------------------------------------------------------------


def _validate(cfg: DraftQuantizeConfig):
    from qfd.quant.gptq import GPTQConfig

    model = drafter_dir(cfg.drafter)
    if model.is_quantized:
        raise QfdError(f"{model.path} is already quantized ({model.quantization_config.get('quant_method')}); pass the BF16 drafter")
    if cfg.format not in FORMATS:
        raise QfdError(f"--format {cfg.format}: use one of {', '.join(FORMATS)}")
    GPTQConfig(group_size=cfg.group_size, damp=cfg.damp, backend=cfg.backend, block_size=max(128, cfg.group_size)).validate()
    for flag, value in (("--samples", cfg.samples), ("--anchors-per-sample", cfg.anchors_per_sample), ("--max-length", cfg.max_length)):
        if value < 1:
            raise QfdError(f"{flag} must be >= 1 (got {value})")
    if cfg.data is not None and not Path(cfg.data).expanduser().is_dir():
        raise QfdError(f"--data {cfg.data} is not a directory; pass a `qfd draft data` output")
    if Path(cfg.out).expanduser().resolve() == model.path:
        raise QfdError("--out must differ from --drafter: inputs are never modified")
    target = resolve_model(cfg.target)
    from qfd.models.drafter_io import verify_drafter_target

    verify_drafter_target(model.path, target.path, allow_mismatch=cfg.allow_target_mismatch or _pins_no_target(model.path))
    return model, target


def _pins_no_target(directory: Path) -> bool:
    manifest = read_manifest(directory) or {}
    return not any(p.get("role") == "target" for p in manifest.get("parents", []))


def load_drafter_any(directory: Path, device="cpu", dtype=None):
    """A DFlashDrafter from a BF16 or an INT4 drafter directory (load_drafter handles both)."""
    import torch

    from qfd.models.drafter_io import load_drafter

    return load_drafter(Path(directory), device=device, dtype=dtype or torch.float32)


# ---------------------------------------------------------------------------------------------
# Calibration data


def conversations(cfg: DraftQuantizeConfig, target_model, tokenizer, needed: int) -> list[Conversation]:
    """`needed` target-generated conversations (prompt + response ids), from --data or
    generated now from GSM8K train prompts. Empty responses are skipped."""
    import torch

    if cfg.data is not None:
        from qfd.data import load_data_dir

        records, _ = load_data_dir(Path(cfg.data))
    else:
        from qfd.data import generate_responses, load_prompts

        prompts = load_prompts(None, limit=needed)
        records = generate_responses(target_model, tokenizer, prompts, max_new_tokens=cfg.gen_tokens, batch_size=8, seed=cfg.seed)
    out = []
    for record in records:
        prompt, response = list(record["prompt_ids"]), list(record["response_ids"])
        ids = (prompt + response)[: cfg.max_length]
        if len(ids) - len(prompt) < 2:
            continue
        out.append(Conversation(torch.tensor(ids, dtype=torch.long), len(prompt)))
        if len(out) == needed:
            break
    if len(out) < 2:
        raise QfdError(f"only {len(out)} usable conversations (responses of >= 2 tokens within --max-length {cfg.max_length}); give more data")
    return out


def attach_taps(convs: Sequence[Conversation], target_model, layer_ids: Sequence[int], device) -> None:
    """taps [1, T, k*H] = transformers hidden_states[i + 1] of the tap layers, concatenated
    (kept on the CPU in the target's dtype: computed once, reused by every GPTQ pass)."""
    import torch

    from qfd.console import progress_bar

    with progress_bar(transient=True) as bar, torch.no_grad():
        task = bar.add_task("target features", total=len(convs))
        for conv in convs:
            out = target_model(input_ids=conv.input_ids.view(1, -1).to(device), output_hidden_states=True)
            conv.taps = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1).cpu()
            bar.update(task, advance=1)


def sample_anchors(conv: Conversation, count: int, generator) -> "torch.Tensor":
    """Up to `count` distinct anchors in the response region [response_start, T - 2] (each
    block's slot 1 needs a real label), sorted. [N] long."""
    import torch

    t = conv.input_ids.numel()
    lo, hi = conv.response_start, t - 2
    span = hi - lo + 1
    pick = torch.randperm(span, generator=generator)[: min(count, span)]
    return (pick + lo).sort().values


# ---------------------------------------------------------------------------------------------
# Acceptance (teacher-forced, greedy): E[tau] of the drafter's blocks on held-out conversations


def expected_acceptance(drafter, convs, anchors, embed, head, device) -> dict:
    """E[tau] = 1 + sum_k prod_{j<=k} acc_j over the blocks at `anchors` (qfd.drafter_losses)."""
    import torch

    from qfd.drafter_losses import acceptance_counts, acceptance_summary, block_labels

    totals = None
    with torch.no_grad():
        for conv, anc in zip(convs, anchors):
            ids = conv.input_ids.to(device)
            anc = anc.to(device)
            hidden = drafter.forward_train(conv.taps.to(device), ids, anc, embed)
            logits = head(hidden.to(head.weight.dtype))
            labels, valid = block_labels(ids, anc, drafter.block_size)
            counts = acceptance_counts(logits.argmax(-1) == labels, valid)
            totals = counts if totals is None else tuple(a + b for a, b in zip(totals, counts))
    return acceptance_summary(*totals)


# ---------------------------------------------------------------------------------------------


def run(cfg: DraftQuantizeConfig) -> Path:
    import torch

    from qfd.console import console, progress_bar
    from qfd.device import pick_device, pick_dtype
    from qfd.models.hf import load_hf_causal_lm, load_tokenizer
    from qfd.quant.gptq import GPTQConfig, gptq_quantize_module, groups_by_block, linear_names

    drafter_model, target_dir = _validate(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    drafter = load_drafter_any(drafter_model.path, device=device, dtype=dtype)
    _check_group_size(drafter, cfg.group_size)
    staging = Staging(cfg.out, overwrite=cfg.overwrite, fresh=True)
    console.print(f"loading target {target_dir.path} ({device}, {str(dtype).removeprefix('torch.')})")
    target = load_hf_causal_lm(target_dir, device=device, dtype=dtype)
    tokenizer = load_tokenizer(target_dir) if cfg.data is None else None
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()

    n_eval = min(cfg.eval_samples, max(1, cfg.samples // 4))
    convs = conversations(cfg, target, tokenizer, cfg.samples + n_eval)
    if len(convs) <= n_eval:
        n_eval = max(1, len(convs) // 4)
    calib, held_out = convs[: len(convs) - n_eval], convs[len(convs) - n_eval :]
    attach_taps(convs, target, drafter.cfg.target_layer_ids, device)
    gen = torch.Generator().manual_seed(cfg.seed)
    calib_anchors = [sample_anchors(c, cfg.anchors_per_sample, gen) for c in calib]
    eval_anchors = [sample_anchors(c, cfg.eval_anchors, gen) for c in held_out]

    def calibrate() -> None:
        """Real drafter block forwards: all anchors of one conversation in one forward."""
        for conv, anc in zip(calib, calib_anchors):
            drafter.forward_train(conv.taps.to(device), conv.input_ids.to(device), anc.to(device), embed)

    scale_dtype = "float16" if cfg.format == "gptq" else _stored_dtype(drafter_model.config)
    gcfg = GPTQConfig(group_size=cfg.group_size, damp=cfg.damp, backend=cfg.backend, block_size=max(128, cfg.group_size), scale_dtype=scale_dtype)
    names = linear_names(drafter)
    groups = groups_by_block(names, first=("fc",)) if cfg.sequential else [names]

    tau_bf16 = expected_acceptance(drafter, held_out, eval_anchors, embed, head, device)
    with progress_bar() as bar:
        task = bar.add_task("GPTQ", total=len(names))
        result = gptq_quantize_module(drafter, calibrate, gcfg, groups=groups, on_layer=lambda e: bar.update(task, advance=1, postfix=f"{e.name} x{e.ratio:.2f} of RTN"))
    tau_rtn = _tau_with(drafter, _rtn_weights(drafter, names, gcfg), held_out, eval_anchors, embed, head, device)
    tau_gptq = _tau_with(drafter, result.qweights, held_out, eval_anchors, embed, head, device)

    _save(staging.path, drafter_model, drafter, result.qweights, cfg, gcfg)
    errors = {name: e.to_dict() for name, e in result.errors.items()}
    total_gptq = sum(e.hessian_gptq for e in result.errors.values())
    total_rtn = sum(e.hessian_rtn for e in result.errors.values())
    metrics = {
        "layer_errors": errors,
        "layers_better_than_rtn": sum(e.hessian_gptq <= e.hessian_rtn for e in result.errors.values()),
        "layers": len(errors),
        "hessian_error_gptq_total": total_gptq,
        "hessian_error_rtn_total": total_rtn,
        "expected_acceptance_length": {"bf16": tau_bf16["expected_acceptance_length"], "rtn": tau_rtn["expected_acceptance_length"], "gptq": tau_gptq["expected_acceptance_length"]},
        "accuracy_per_position": {"bf16": tau_bf16["accuracy_per_position"], "gptq": tau_gptq["accuracy_per_position"]},
        "calibration": {"conversations": len(calib), "blocks": int(sum(a.numel() for a in calib_anchors)), "context_tokens": int(sum(c.input_ids.numel() for c in calib))},
        "held_out": {"conversations": len(held_out), "blocks": tau_gptq["eval_blocks"]},
    }
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config.update({"gptq": asdict(gcfg), "transforms": prior_transforms(drafter_model.path) + ["quantize"], "sequential_groups": groups})
    return staging.commit(stage=STAGE, parents={"drafter": drafter_model.path, "target": target_dir.path}, config=config, metrics=metrics)


def _check_group_size(drafter, group_size: int) -> None:
    """Every linear's in_features must be a multiple of the group size (checked before any work)."""
    import torch

    bad = sorted({m.in_features for m in drafter.modules() if isinstance(m, torch.nn.Linear) and m.in_features % group_size})
    if bad:
        fits = [g for g in (128, 64, 32) if all(f % g == 0 for f in bad)]
        hint = f"use --group-size {fits[0]}" if fits else "no supported group size divides them"
        raise QfdError(f"--group-size {group_size} does not divide the drafter's input widths {bad}; {hint}")


def _stored_dtype(config: dict) -> str:
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return name if name in ("float16", "bfloat16", "float32") else "bfloat16"


def _rtn_weights(drafter, names, gcfg):
    from qfd.quant.grid import rtn_quantize

    modules = dict(drafter.named_modules())
    return {n: rtn_quantize(modules[n].weight.detach().float(), gcfg.group_size, gcfg.bits, True, gcfg.torch_scale_dtype) for n in names}


def _tau_with(drafter, qweights, convs, anchors, embed, head, device) -> dict:
    """E[tau] with the dequantized `qweights` in place (original weights restored after)."""
    import torch

    from qfd.quant.grid import dequantize

    modules = dict(drafter.named_modules())
    saved = {n: modules[n].weight.detach().clone() for n in qweights}
    try:
        with torch.no_grad():
            for n, qw in qweights.items():
                modules[n].weight.copy_(dequantize(qw, modules[n].weight.dtype))
        return expected_acceptance(drafter, convs, anchors, embed, head, device)
    finally:
        with torch.no_grad():
            for n, w in saved.items():
                modules[n].weight.copy_(w)


def _save(directory: Path, drafter_model, drafter, qweights, cfg: DraftQuantizeConfig, gcfg) -> None:
    """config.json (the drafter's, + quantization_config) and the INT4 safetensors; other
    files of the drafter directory (tokenizer, draft vocabulary) are copied forward."""
    import torch

    from qfd.quant.formats import build_checkpoint, save_quantized

    stored = getattr(torch, _stored_dtype(drafter_model.config))
    dense = {name: t.detach().to("cpu", stored if t.is_floating_point() else t.dtype).contiguous() for name, t in drafter.state_dict().items()}
    cpu_qweights = {n: _to_cpu(qw) for n, qw in qweights.items()}
    ckpt = build_checkpoint(cfg.format, dict(drafter_model.config), dense, cpu_qweights, bits=gcfg.bits, group_size=gcfg.group_size, symmetric=True)
    save_quantized(directory, ckpt)
    for path in drafter_model.path.iterdir():  # the draft vocabulary's counts still hold for the INT4 drafter
        if path.is_file() and (path.name in TOKENIZER_FILES or path.name == DRAFT_VOCAB_NAME):
            shutil.copy2(path, directory / path.name)


def _to_cpu(qw):
    from qfd.quant.types import QuantizedWeight

    return QuantizedWeight(codes=qw.codes.cpu(), scales=qw.scales.cpu(), zeros=None if qw.zeros is None else qw.zeros.cpu(), group_size=qw.group_size, bits=qw.bits, bias=None if qw.bias is None else qw.bias.cpu())


def summary_table(directory: Path):
    """A rich table of a finished quantize directory: per-layer GPTQ vs RTN, and E[tau]."""
    from rich.table import Table

    manifest = read_manifest(directory) or {}
    metrics = manifest.get("metrics", {})
    table = Table(title=f"drafter GPTQ INT4 ({manifest.get('config', {}).get('format')}, group {manifest.get('config', {}).get('group_size')})")
    for column in ("layer", "shape", "H-err GPTQ", "H-err RTN", "GPTQ/RTN", "MSE GPTQ", "MSE RTN"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    for name, e in metrics.get("layer_errors", {}).items():
        table.add_row(name, "x".join(map(str, e["shape"])), f"{e['hessian_gptq']:.4g}", f"{e['hessian_rtn']:.4g}", f"{e['ratio']:.3f}", f"{e['mse_gptq']:.3g}", f"{e['mse_rtn']:.3g}")
    tau = metrics.get("expected_acceptance_length", {})
    if tau:
        table.caption = "E[tau] held-out: " + ", ".join(f"{k} {v:.3f}" for k, v in tau.items())
    return table
