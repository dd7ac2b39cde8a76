"""`qfd quantize`: the INT4 start point for a BF16 model (RTN, GPTQ or AWQ; any qfd format)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from qfd.errors import QfdError

METHODS = ("gptq", "awq", "rtn")


@dataclass(frozen=True)
class QuantizeConfig:
    model: str
    out: Path
    method: str = "gptq"
    group_size: int | None = None  # None: 128 if it divides every linear's in_features, else 64, else 32
    bits: int = 4
    format: str = "compressed-tensors"
    symmetric: bool | None = None  # None: asymmetric for awq (and the awq format), else symmetric
    calib_data: str | None = None
    samples: int = 64
    seq_len: int = 512
    damp: float = 0.01
    overwrite: bool = False


def validate(cfg: QuantizeConfig) -> None:
    from qfd.quant.formats import FORMATS
    from qfd.quant.grid import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

    if cfg.method not in METHODS:
        raise QfdError(f"unknown --method '{cfg.method}'; use one of {', '.join(METHODS)}")
    if cfg.format not in FORMATS:
        raise QfdError(f"unknown --format '{cfg.format}'; use one of {', '.join(FORMATS)}")
    if cfg.bits not in SUPPORTED_BITS:
        raise QfdError(f"unsupported --bits {cfg.bits}; qfd writes INT4 only")
    if cfg.group_size is not None and cfg.group_size not in SUPPORTED_GROUP_SIZES:
        raise QfdError(f"unsupported --group-size {cfg.group_size}; use one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))}")
    if cfg.samples < 1:
        raise QfdError("--samples must be at least 1")
    if cfg.format == "awq" and cfg.symmetric:
        raise QfdError("the AutoAWQ GEMM format stores zero points: drop --sym or pick --format compressed-tensors/gptq")


def resolve_symmetric(cfg: QuantizeConfig) -> bool:
    if cfg.symmetric is not None:
        return cfg.symmetric
    return not (cfg.method == "awq" or cfg.format == "awq")


def pick_group_size(requested: int | None, in_features: list[int]) -> int:
    for g in ([requested] if requested else [128, 64, 32]):
        if all(n % g == 0 for n in in_features):
            return g
    raise QfdError(f"--group-size {requested} does not divide the in_features of every linear ({sorted(set(in_features))}); use 64 or 32")


def calibration_texts(source: str | None, limit: int) -> list[str]:
    """Plain texts: GSM8K train question + answer by default (../shared/data), else a file."""
    from qfd.data import default_prompts_path

    path = Path(source).expanduser() if source else default_prompts_path()
    if not path.is_file():
        raise QfdError(f"--calib-data {path} does not exist; give a .jsonl or .txt file")
    texts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".txt":
            texts.append(line)
        else:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise QfdError(f"{path} is not JSONL; give one JSON object per line or a .txt file") from None
            text = row.get("text") or "\n".join(str(row[k]) for k in ("question", "answer", "prompt", "response") if isinstance(row.get(k), str))
            if text:
                texts.append(text)
        if len(texts) >= limit:
            break
    if not texts:
        raise QfdError(f"--calib-data {path}: no text found")
    return texts


def _calibration_batches(tokenizer, texts: list[str], seq_len: int):
    import torch

    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :seq_len]
        if ids.shape[1] > 1:
            yield ids.to(torch.long)


def run(cfg: QuantizeConfig) -> tuple[Path, dict]:
    """Quantize, write `cfg.out` (staged), return (path, metrics)."""
    validate(cfg)
    from qfd.checkpoint import Staging, copy_tokenizer_files, resolve_model

    source = resolve_model(cfg.model)
    if source.is_quantized:
        raise QfdError(f"{source.path} is already quantized ({source.quantization_config.get('quant_method')}); give the BF16 model")
    symmetric = resolve_symmetric(cfg)
    staging = Staging(cfg.out, overwrite=cfg.overwrite)

    import torch
    from safetensors.torch import load_file

    from qfd.console import console
    from qfd.models.hf import load_hf_causal_lm, load_tokenizer
    from qfd.quant import calibrate
    from qfd.quant.formats import build_checkpoint, save_quantized

    model = load_hf_causal_lm(source, "cpu", torch.float32)
    linears = calibrate.quantizable_linears(model)
    group_size = pick_group_size(cfg.group_size, [m.in_features for m in linears.values()])
    # compressed-tensors keeps scales in the model dtype; AutoAWQ/GPTQ in fp16
    scale_dtype = torch.bfloat16 if cfg.format == "compressed-tensors" else torch.float16
    console.print(f"[dim]{cfg.method} INT{cfg.bits} group {group_size} {'symmetric' if symmetric else 'zero-point'} -> {cfg.format}, {len(linears)} linears[/dim]")
    texts = calibration_texts(cfg.calib_data, cfg.samples) if cfg.method != "rtn" else []
    dense = {}
    for path in source.weight_files:
        dense.update(load_file(str(path)))
    if cfg.method == "awq":
        qweights = _awq_via_gptqmodel(source.path, texts, group_size, cfg.bits)
    else:
        qweights = {}
        hessians = {}
        if cfg.method == "gptq":
            tokenizer = load_tokenizer(source)
            with console.status("collecting Hessians"):
                hessians = calibrate.collect_hessians(model, linears, _calibration_batches(tokenizer, texts, cfg.seq_len))
        from qfd.console import progress_bar

        with progress_bar() as bar:
            task = bar.add_task(f"{cfg.method}", total=len(linears))
            for name, module in linears.items():
                if cfg.method == "gptq":
                    qw = calibrate.gptq_quantize(module.weight, hessians.pop(name), group_size, cfg.bits, symmetric, cfg.damp, scale_dtype=scale_dtype)
                else:
                    qw = calibrate.rtn_quantize(module.weight, group_size, cfg.bits, symmetric, scale_dtype=scale_dtype)
                qw.bias = dense.get(f"{name}.bias")
                qweights[name] = qw
                bar.update(task, advance=1)
    qweights = {name: _to_format(qw, cfg.format) for name, qw in qweights.items()}
    ckpt = build_checkpoint(cfg.format, source.config, dense, qweights, bits=cfg.bits, group_size=group_size, symmetric=symmetric)
    save_quantized(staging.path, ckpt)
    copy_tokenizer_files(source.path, staging.path)
    # a quick quality number of the result against the source (held-out GSM8K test text)
    metrics = {"group_size": group_size, "symmetric": symmetric, "linears": len(qweights)}
    metrics.update(_quick_kl(model, staging.path, source))
    out = staging.commit(stage="quantize", parents={"model": source.path}, config={**asdict(cfg), "out": str(cfg.out), "group_size": group_size, "symmetric": symmetric}, metrics=metrics)
    return out, metrics


def _to_format(qw, format_name: str):
    """Make a QuantizedWeight representable in `format_name` (exact: q - z is unchanged)."""
    import torch

    from qfd.quant.types import QuantizedWeight

    if format_name == "awq" and qw.zeros is None:
        return QuantizedWeight((qw.codes.to(torch.int16) + 8).to(torch.uint8), qw.scales, torch.full(qw.scales.shape, 8, dtype=torch.uint8), qw.group_size, qw.bits, qw.bias)
    if format_name == "gptq" and qw.zeros is not None:
        if int(qw.zeros.min()) < 1:  # v1 cannot store z = 0 (it is written as -1 and read back as 16)
            raise QfdError("this zero-point grid has zero points of 0, which GPTQ v1 cannot store; use --format compressed-tensors or awq")
        return QuantizedWeight(qw.codes, qw.scales.to(torch.float16), qw.zeros.to(torch.int16), qw.group_size, qw.bits, qw.bias)
    if format_name == "compressed-tensors" and qw.zeros is not None and int(qw.zeros.max()) > 15:
        raise QfdError("zero points of 16 (GPTQ v1) do not fit compressed-tensors; use --format gptq")
    return qw


def _awq_via_gptqmodel(model_dir: Path, texts: list[str], group_size: int, bits: int):
    from qfd.quant.calibrate import gptqmodel_awq
    from qfd.quant.formats import load_quantized

    with tempfile.TemporaryDirectory(prefix="qfd-awq-") as tmp:
        ckpt = load_quantized(gptqmodel_awq(model_dir, Path(tmp) / "awq", texts, group_size, bits))
    return ckpt.qweights


def _quick_kl(teacher, int4_dir: Path, source) -> dict:
    """KL(source || INT4) and both perplexities on 4 x 256 tokens of GSM8K test text."""
    import torch

    from qfd.checkpoint import inspect_model_dir
    from qfd.data import repo_root
    from qfd.models.hf import load_hf_int4_runtime, load_tokenizer
    from qfd.qad_data import load_documents, pack_blocks
    from qfd.qad_trainer import Evaluator

    test = repo_root().parent / "shared" / "data" / "gsm8k" / "test.jsonl"
    tokenizer = load_tokenizer(source)
    if not test.is_file() or tokenizer is None:
        return {}
    blocks = pack_blocks(load_documents(test, tokenizer, limit=40), 256, tokenizer.eos_token_id)[:4]
    if blocks.shape[0] == 0:
        return {}
    evaluator = Evaluator(teacher, blocks, torch.device("cpu"), kl_chunk=512)
    student = load_hf_int4_runtime(inspect_model_dir(int4_dir), "cpu", torch.float32)
    result = evaluator(student)
    return {"heldout_kl": result["kl"], "heldout_ppl": result["ppl"], "source_ppl": evaluator(teacher)["ppl"]}
