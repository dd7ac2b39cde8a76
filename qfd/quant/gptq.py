"""GPTQ for modules whose forward is not token-driven (the DFlash drafter), driven from hooks.

GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", Alg. 1) quantizes one linear's weight W [out, in] column by column,
spreading each column's rounding error over the not-yet-quantized columns through the inverse
of the damped input Hessian H = 2 X^T X (X [n, in]: the layer's inputs), with lazy block updates.

A stock `quantize(model, texts)` call does not fit a drafter (method.md section 3): its forward
takes target context features and anchor blocks, not token ids. So this module only needs a
caller-supplied `calibrate()` callable that runs real forwards of the module; forward hooks on
every nn.Linear collect the Hessians while it runs. Per-layer math has two backends:

- "gptqmodel" (default): gptqmodel 7.6's own per-layer `GPTQ.quantize()` (its Cholesky inverse,
  column loop and block updates) fed with our Hessian, with its quantizer replaced by one on
  qfd's grid (`qfd.quant.grid`: symmetric codes -8..7, s = max|w| / 7 per group, fp16 scales),
  so GPTQ and round-to-nearest (RTN) live on the same grid.
- "reference": the standard algorithm written out here (`gptq_quantize_weight`), used in tests
  to cross-check gptqmodel and as a fallback where gptqmodel is not importable.

Both: weight-only INT4 symmetric, group 128, damping 0.01 * mean(diag H), no act-order, group
scales computed from the (error-updated) weights when a group starts. Layers are quantized
sequentially when `groups` are given: later groups are calibrated on the outputs of already
quantized earlier groups (GPTQ paper section 4, "sequential" quantization).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from qfd.errors import QfdError
from qfd.quant.grid import check_supported, dequantize, qrange, rtn_quantize
from qfd.quant.types import QuantizedWeight

BACKENDS = ("gptqmodel", "reference")
_SCALE_FLOOR = 1e-8  # same floor as grid.rtn_quantize: an all-zero group gets a tiny scale


@dataclass(frozen=True)
class GPTQConfig:
    """Weight-only GPTQ settings (method.md section 3 defaults)."""

    bits: int = 4
    group_size: int = 128
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal
    block_size: int = 128  # lazy-update block; a multiple of group_size (see _check_config)
    backend: str = "gptqmodel"
    scale_dtype: str = "float16"  # dtype scales are stored in; GPTQ rounds on exactly these

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return getattr(torch, self.scale_dtype)

    def validate(self) -> None:
        """QfdError for settings qfd cannot honour (checked before any calibration work)."""
        if self.backend not in BACKENDS:
            raise QfdError(f"unknown GPTQ backend '{self.backend}'; use one of {', '.join(BACKENDS)}")
        check_supported(self.bits, self.group_size, where="GPTQ")
        if not 0.0 < self.damp < 1.0:
            raise QfdError(f"GPTQ damping {self.damp} must be in (0, 1) (a fraction of mean(diag H); 0.01 is standard)")
        if self.block_size % self.group_size:
            raise QfdError(f"GPTQ block size {self.block_size} must be a multiple of the group size {self.group_size}")
        if self.scale_dtype not in ("float16", "bfloat16", "float32"):
            raise QfdError(f"scale dtype {self.scale_dtype} must be float16, bfloat16 or float32")


@dataclass(frozen=True)
class LayerError:
    """Quantization error of one linear on its calibration inputs, GPTQ vs RTN on the same grid.

    hessian_*: tr((W - Q) H (W - Q)^T) with H = 2 X^T X / n (per calibration token), the
    quantity GPTQ minimises; mse_*: mean squared output error E ||x (W - Q)^T||^2 / out,
    i.e. hessian / (2 out); rel_*: hessian error / tr(W H W^T), the output error energy
    relative to the output energy."""

    name: str
    shape: tuple[int, int]
    tokens: int
    hessian_gptq: float
    hessian_rtn: float
    mse_gptq: float
    mse_rtn: float
    rel_gptq: float
    rel_rtn: float
    damp: float

    @property
    def ratio(self) -> float:
        """GPTQ error / RTN error (< 1: GPTQ is better)."""
        return self.hessian_gptq / self.hessian_rtn if self.hessian_rtn > 0 else 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["ratio"] = self.ratio
        return d


@dataclass
class GPTQResult:
    qweights: dict[str, QuantizedWeight] = field(default_factory=dict)
    errors: dict[str, LayerError] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Pure math


def _check_config(config: GPTQConfig, in_features: int) -> None:
    # Blocks are a multiple of the group size (validate), so every group lies inside one block
    # and the weights a group's scale is computed from already carry all earlier updates.
    config.validate()
    if in_features % config.group_size:
        raise QfdError(f"in_features {in_features} is not a multiple of group size {config.group_size}; choose a group size that divides it")


def group_scale(weight_group: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Symmetric scale of one group [out, g] -> [out] fp32, rounded through `scale_dtype`.

    Same rule as qfd.quant.grid.rtn_quantize (s = max|w| / (2^(b-1) - 1)), and rounded to the
    stored dtype first, so the codes GPTQ picks are exact on the scales written to disk."""
    qmax = qrange(bits, True)[1]
    scale = (weight_group.abs().amax(dim=1) / qmax).clamp_min(_SCALE_FLOOR)
    return scale.to(scale_dtype).to(torch.float32)


def damped_inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) I)^-1, [in, in] fp32 (GPTQ eq. 3 + 4)."""
    h = hessian.to(torch.float32).clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    lower = torch.linalg.cholesky(h)
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)


def _prepare(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies; 'dead' inputs (never non-zero in calibration) get H_jj = 1 and W[:, j] = 0,
    as in the GPTQ reference code: their weight never affects a calibration output."""
    w = weight.detach().to(torch.float32).clone()
    h = hessian.detach().to(torch.float32).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    return w, h


def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, config: GPTQConfig = GPTQConfig()) -> QuantizedWeight:
    """The standard GPTQ algorithm (reference backend). weight [out, in], hessian [in, in].

    Returns codes [out, in] int8 in [-8, 7] and scales [out, in // g] in config.scale_dtype."""
    _check_config(config, weight.shape[1])
    w, h = _prepare(weight, hessian)
    out_features, in_features = w.shape
    g, bits = config.group_size, config.bits
    qmin, qmax = qrange(bits, True)
    hinv = damped_inverse_cholesky(h, config.damp)
    codes = torch.zeros(out_features, in_features, dtype=torch.int8, device=w.device)
    scales = torch.zeros(out_features, in_features // g, dtype=torch.float32, device=w.device)
    for i1 in range(0, in_features, config.block_size):
        i2 = min(i1 + config.block_size, in_features)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        scale = None
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:  # a group starts: its scale from the error-updated weights
                scale = group_scale(w1[:, i : i + g], bits, config.torch_scale_dtype)
                scales[:, col // g] = scale
            column = w1[:, i]
            q = torch.clamp(torch.round(column / scale), qmin, qmax)
            codes[:, col] = q.to(torch.int8)
            err = (column - q * scale) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]  # lazy batch update of the later columns
    return QuantizedWeight(codes=codes, scales=scales.to(config.torch_scale_dtype), zeros=None, group_size=g, bits=bits)


def _gptqmodel_classes():
    """gptqmodel's GPTQ with its quantizer swapped for one on qfd's grid (imported lazily:
    the import costs ~10 s). GPTQMODEL_CPU_WORKERS must be set before import on small boxes."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    try:
        from gptqmodel.quantization.config import QuantizeConfig
        from gptqmodel.quantization.gptq import GPTQ
        from gptqmodel.quantization.quantizer import Quantizer
    except Exception as exc:  # not installed / incompatible build
        raise QfdError(f"gptqmodel could not be imported ({type(exc).__name__}: {exc}); install gptqmodel==7.6.* or use backend 'reference'") from None

    class QfdGridQuantizer(Quantizer):
        """gptqmodel stores symmetric codes as q in [0, 15] with zero 8 (w = s (q - 8)),
        i.e. signed codes -8..7; only the scale rule differs from qfd's, so override it."""

        scale_dtype = torch.float16

        def find_params(self, x, weight=False):  # noqa: D401 - gptqmodel's signature
            self.maxq = torch.tensor((1 << self.qcfg.bits) - 1, device=x.device)
            scale = group_scale(x.flatten(1).to(torch.float32), self.qcfg.bits, self.scale_dtype)
            self.scale = scale.reshape(-1, 1)
            self.zero = torch.full_like(self.scale, float(1 << (self.qcfg.bits - 1)))

    class QfdGPTQ(GPTQ):
        def create_quantizer(self, name):
            return QfdGridQuantizer(qcfg=self.qcfg, name=name)

    return QuantizeConfig, QfdGPTQ


def gptqmodel_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, tokens: int, config: GPTQConfig = GPTQConfig()) -> tuple[QuantizedWeight, float]:
    """GPTQ of one weight [out, in] through gptqmodel's per-layer math, fed our Hessian [in, in].

    Returns the QuantizedWeight and the damping gptqmodel actually used (it retries with a
    floored diagonal if the Cholesky fails; 1.0 means it fell back to RTN)."""
    _check_config(config, weight.shape[1])
    QuantizeConfig, QfdGPTQ = _gptqmodel_classes()
    w, h = _prepare(weight, hessian)
    holder = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=torch.float32)
    with torch.no_grad():
        holder.weight.copy_(w)
    qcfg = QuantizeConfig(
        bits=config.bits, group_size=config.group_size, sym=True, desc_act=False, act_group_aware=False,
        static_groups=False, damp_percent=config.damp, damp_auto_increment=0.0, mse=0.0,
        offload_to_disk=False, fallback=None,
    )
    task = QfdGPTQ(holder, qcfg)
    task.quantizer.configure(perchannel=True)
    task.quantizer.scale_dtype = config.torch_scale_dtype
    # Inject the Hessian: with H set and nothing pending, gptqmodel uses it as-is.
    task.H = h
    task.nsamples = max(int(tokens), 1)
    dequant, scale, _zero, _g_idx, _secs, _loss, used_damp, _n = task.quantize(blocksize=config.block_size)
    scales = scale.to(torch.float32)  # [out, in // g]
    full = scales.repeat_interleave(config.group_size, dim=1)
    codes = torch.round(dequant.to(torch.float32) / full).clamp_(*qrange(config.bits, True)).to(torch.int8)
    qw = QuantizedWeight(codes=codes, scales=scales.to(config.torch_scale_dtype), zeros=None, group_size=config.group_size, bits=config.bits)
    return qw, float(used_damp)


def weighted_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) in float64. weight/approx [out, in], hessian [in, in]."""
    delta = (weight.to(torch.float64) - approx.to(torch.float64))
    return float(((delta @ hessian.to(torch.float64)) * delta).sum())


def layer_error(name: str, weight: torch.Tensor, gptq: QuantizedWeight, hessian: torch.Tensor, tokens: int, config: GPTQConfig, damp: float) -> LayerError:
    """GPTQ vs RTN (qfd.quant.grid.rtn_quantize, same grid) on the per-token Hessian [in, in]."""
    w, h = _prepare(weight, hessian)
    rtn = rtn_quantize(w, config.group_size, config.bits, symmetric=True, scale_dtype=config.torch_scale_dtype)
    err_gptq = weighted_error(w, dequantize(gptq), h)
    err_rtn = weighted_error(w, dequantize(rtn), h)
    energy = weighted_error(w, torch.zeros_like(w), h)
    out_features = w.shape[0]
    return LayerError(
        name=name, shape=tuple(w.shape), tokens=int(tokens),
        hessian_gptq=err_gptq, hessian_rtn=err_rtn,
        mse_gptq=err_gptq / (2 * out_features), mse_rtn=err_rtn / (2 * out_features),
        rel_gptq=err_gptq / energy if energy > 0 else 0.0, rel_rtn=err_rtn / energy if energy > 0 else 0.0,
        damp=damp,
    )


def quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, tokens: int, config: GPTQConfig) -> tuple[QuantizedWeight, float]:
    """GPTQ of one weight with the configured backend -> (QuantizedWeight, damping used)."""
    if config.backend == "gptqmodel":
        return gptqmodel_quantize_weight(weight, hessian, tokens, config)
    _check_config(config, weight.shape[1])
    return gptq_quantize_weight(weight, hessian, config), config.damp


# ---------------------------------------------------------------------------------------------
# Hessians from forward hooks


class HessianCollector:
    """Forward hooks that accumulate X^T X (fp32, on the module's device) and the token count
    for each named nn.Linear while real forwards run. A linear called several times per forward
    (the drafter's k/v projections see context features and block states) accumulates all calls.

        with HessianCollector(model, ["layers.0.mlp.up_proj", ...]) as hc:
            calibrate()
        H, n = hc.hessian("layers.0.mlp.up_proj")    # H = 2 X^T X / n, [in, in]
    """

    def __init__(self, module: nn.Module, names: Iterable[str]):
        modules = dict(module.named_modules())
        self.linears: dict[str, nn.Linear] = {}
        for name in names:
            if not isinstance(modules.get(name), nn.Linear):
                raise QfdError(f"{name} is not an nn.Linear of the module being quantized")
            self.linears[name] = modules[name]
        self.xtx: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {name: 0 for name in self.linears}
        self._handles: list = []

    def _hook(self, name: str):
        def hook(mod: nn.Module, inputs: tuple, _output) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float32)
            if name not in self.xtx:
                self.xtx[name] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
            self.xtx[name].addmm_(x.T, x)
            self.tokens[name] += x.shape[0]

        return hook

    def __enter__(self) -> "HessianCollector":
        for name, linear in self.linears.items():
            self._handles.append(linear.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def hessian(self, name: str) -> tuple[torch.Tensor, int]:
        """(H = 2 X^T X / n [in, in] fp32, n tokens). QfdError if calibration never reached it."""
        n = self.tokens[name]
        if n == 0:
            raise QfdError(f"calibration forwards never reached {name}: its Hessian is empty; check the calibration data")
        return self.xtx[name] * (2.0 / n), n


def linear_names(module: nn.Module) -> list[str]:
    """Every nn.Linear in `module`, in registration order."""
    return [name for name, sub in module.named_modules() if isinstance(sub, nn.Linear)]


def groups_by_block(names: Sequence[str], first: Sequence[str] = ()) -> list[list[str]]:
    """Sequential quantization groups: names sharing the prefix up to their first numeric path
    component ("layers.3.self_attn.q_proj" -> "layers.3") form one group, in order of first
    appearance; names without a numeric component are their own group. Groups whose key is in
    `first` (e.g. the fusion "fc", which runs before every layer) go first."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        key = ".".join(parts[: idx + 1]) if idx is not None else name
        groups.setdefault(key, []).append(name)
    keys = [k for k in groups if k in first] + [k for k in groups if k not in first]
    return [groups[k] for k in keys]


@torch.no_grad()
def gptq_quantize_module(
    module: nn.Module,
    calibrate: Callable[[], None],
    config: GPTQConfig = GPTQConfig(),
    *,
    groups: Sequence[Sequence[str]] | None = None,
    on_layer: Callable[[LayerError], None] | None = None,
) -> GPTQResult:
    """GPTQ every linear named in `groups` (default: all nn.Linear of `module`, one group).

    For each group in order: attach Hessian hooks, run `calibrate()` (real forwards of
    `module`), quantize each linear of the group, then write its dequantized weight into the
    module so the next group calibrates on quantized outputs (sequential GPTQ). The original
    weights are restored before returning: the module is not modified. `on_layer` is called
    after each linear (for progress bars). Biases are carried into QuantizedWeight.bias."""
    config.validate()
    groups = [list(g) for g in (groups if groups is not None else [linear_names(module)])]
    modules = dict(module.named_modules())
    originals: dict[str, torch.Tensor] = {}
    result = GPTQResult()
    try:
        for group in groups:
            with HessianCollector(module, group) as collector:
                calibrate()
            for name in group:
                linear = modules[name]
                hessian, tokens = collector.hessian(name)
                weight = linear.weight.detach()
                qw, damp = quantize_weight(weight, hessian, tokens, config)
                if linear.bias is not None:
                    qw.bias = linear.bias.detach().clone()
                result.qweights[name] = qw
                result.errors[name] = layer_error(name, weight, qw, hessian, tokens, config, damp)
                originals[name] = weight.clone()
                linear.weight.copy_(dequantize(qw, linear.weight.dtype))
                if on_layer is not None:
                    on_layer(result.errors[name])
            del collector
    finally:
        for name, weight in originals.items():
            modules[name].weight.copy_(weight)
    return result


def error_table_rows(errors: dict[str, LayerError]) -> list[tuple[str, ...]]:
    """Rows (name, shape, GPTQ err, RTN err, ratio, rel GPTQ, rel RTN) for a rich table."""
    rows = []
    for e in errors.values():
        rows.append((e.name, f"{e.shape[0]}x{e.shape[1]}", f"{e.hessian_gptq:.4g}", f"{e.hessian_rtn:.4g}", f"{e.ratio:.3f}", f"{e.rel_gptq:.2e}", f"{e.rel_rtn:.2e}"))
    return rows
