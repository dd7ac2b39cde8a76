"""Calibrated INT4 quantization of a dense transformers model: RTN, GPTQ, AWQ.

- rtn: min/max round-to-nearest per group (qfd.quant.grid.rtn_quantize).
- gptq: the GPTQ algorithm (Frantar et al. 2022, Alg. 1, blocked, lazy batch updates, damping
  0.01 of the mean Hessian diagonal, no act-order) implemented here on qfd's grid. The
  Hessians H = 2 X^T X are gathered in ONE forward pass of the unquantized model (hooks on every
  linear), not layer-sequentially: gptqmodel 7.6's sequential driver took ~30 min for the 135M
  embedded model with 128 samples on 2 CPU cores, this takes well under a minute.
- awq: gptqmodel's AWQ (BACKEND.AWQ_TORCH, pack_impl="original", GPTQMODEL_CPU_WORKERS set
  before import), written as AutoAWQ GEMM and read back with qfd.quant.formats (never its
  dequantize_model, which gives wrong AWQ weights in 7.6.0). Slow on CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from qfd.quant.grid import qrange, rtn_quantize
from qfd.quant.types import QuantizedWeight


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears of the decoder layers (module path -> module); not the LM head / embeddings."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{name}" and "lm_head" not in name}


@torch.no_grad()
def collect_hessians(model: nn.Module, names: Iterable[str], batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """H = 2/N sum x x^T of each named linear's inputs over the calibration batches. [in, in] fp32."""
    modules = dict(model.named_modules())
    hessians: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    def make_hook(name):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            if name not in hessians:
                hessians[name] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
                counts[name] = 0
            hessians[name].addmm_(x.t(), x, alpha=2.0)
            counts[name] += x.shape[0]

        return hook

    for name in names:
        hooks.append(modules[name].register_forward_pre_hook(make_hook(name)))
    try:
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {name: h / max(1, counts[name]) for name, h in hessians.items()}


def _group_grid(w: torch.Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row scale (as stored, scale_dtype) and zero of one group's columns w [out, g]."""
    qw = rtn_quantize(w, w.shape[1], bits=bits, symmetric=symmetric, scale_dtype=scale_dtype)
    return qw.scales[:, 0], None if qw.zeros is None else qw.zeros[:, 0]


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, bits: int = 4, symmetric: bool = True, damp: float = 0.01, block_size: int = 128, scale_dtype: torch.dtype = torch.float16) -> QuantizedWeight:
    """GPTQ one linear: weight [out, in], hessian [in, in]. Group grids are fixed when the
    group's first column is reached (from the error-updated weights), as GPTQ does without
    act-order; codes are computed against the STORED (scale_dtype) scales."""
    W = weight.detach().to(torch.float32).clone()
    H = hessian.to(torch.float32).clone()
    out_features, n = W.shape
    block_size = max(group_size, block_size - block_size % group_size)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(n, dtype=H.dtype, device=H.device)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    qmin, qmax = qrange(bits, symmetric)
    codes = torch.zeros(out_features, n, dtype=torch.int16)
    scales = torch.zeros(out_features, n // group_size, dtype=scale_dtype)
    zeros = None if symmetric else torch.zeros(out_features, n // group_size, dtype=torch.uint8)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                s, z = _group_grid(W1[:, i : i + group_size], bits, symmetric, scale_dtype)
                scales[:, col // group_size] = s
                if zeros is not None:
                    zeros[:, col // group_size] = z
                s32 = s.to(torch.float32)
                z32 = None if z is None else z.to(torch.float32)
            w = W1[:, i]
            q = torch.round(w / s32) + (0 if z32 is None else z32)
            q = q.clamp(qmin, qmax)
            codes[:, col] = q.to(torch.int16)
            wq = (q - (0 if z32 is None else z32)) * s32
            err = (w - wq) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return QuantizedWeight(codes=codes.to(torch.int8 if symmetric else torch.uint8), scales=scales, zeros=zeros, group_size=group_size, bits=bits)


def gptqmodel_awq(model_dir: Path, out_dir: Path, texts: list[str], group_size: int, bits: int = 4) -> Path:
    """AWQ through gptqmodel, written as AutoAWQ GEMM into `out_dir` (read it with load_quantized)."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, min(8, os.cpu_count() or 2))))
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import FORMAT, METHOD

    qcfg = QuantizeConfig(bits=bits, group_size=group_size, sym=False, method=METHOD.AWQ, format=FORMAT.GEMM, pack_impl="original")
    model = GPTQModel.load(str(model_dir), qcfg)
    model.quantize(texts, batch_size=8, backend=BACKEND.AWQ_TORCH)
    model.save(str(out_dir))
    return Path(out_dir)
