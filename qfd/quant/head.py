"""A quantized LM head at load time: `--int4-head` (INT4) or `--int8-head` (INT8); round to
nearest, symmetric, group 128 (64 or 32 where 128 does not divide the hidden size).

Why: at batch 1 a decode step reads every weight once, and a large-vocabulary head is a large
share of them. Qwen3.5-4B's tied head is 248320 x 2560, 1.27 GB in bf16, against ~1.84 GB for
its INT4 body (3.57B parameters: codes + group scales): 40% of an INT4 decode's bytes, 300 us
of a 4.3 ms step on the H200 (docs/benchmarks.md, fifth session). In INT4 it reads 0.33 GB.
(SmolLM2-135M: the 49152 x 576 head is 56 MB in bf16 against a 55 MB INT4 body.)

What it costs: the head's weights move to the INT4 grid, so the target's logits change (AWQ
and GPTQ checkpoints, the paper's included, keep the head in bf16). Speculative decoding stays
lossless with respect to the model being served, which is now the INT4-head model: the
drafter drafts against it and every emitted token is its own argmax. Measure the quality before
serving with it (`bench/bench_int4_head.py`: greedy agreement and KL against the dense head).
On SmolLM2-135M (group 64) it is large: top-1 agreement 0.86, KL 0.10 nats, every greedy
continuation of 16 GSM8K test prompts diverges within ~7 tokens (docs/benchmarks.md): a
different model. Big-vocabulary 4B heads are unmeasured.

INT8 (`Int8Head`, qfd.kernels.int8_triton) halves the head's bytes instead of quartering them
and moves the logits ~4x less than per-row INT8 did: SmolLM2-135M at group 64, top-1 agreement
0.991, KL 1.5e-4 nats, 10 of 16 greedy continuations identical to the dense head's over 64
tokens (per-row INT8, simulated: KL 5.5e-4, 6/16; docs/benchmarks.md). Still a (slightly)
different model - measure it the same way.

A tied head keeps the embedding table dense for the lookups; the head gets its own quantized copy.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128
GROUP_FALLBACKS = (128, 64, 32)  # for widths 128 does not divide (SmolLM2-135M: 576 -> 64)


def head_group_size(width: int) -> int | None:
    """The group size `quantize_head` uses for a head `width` wide: 128, else 64, else 32 (None: none divides)."""
    return next((g for g in GROUP_FALLBACKS if width % g == 0), None)


class Int8Head(torch.nn.Module):
    """y = x @ w_hat.T, w_hat = q * s: `qweight` [V, D] int8 and `scales` [D / g, V] in the
    head's dtype (layout: qfd.kernels.int8_triton). On CUDA (or Triton's interpreter, kernel
    "triton") the product runs the INT8 kernel; elsewhere the module keeps w_hat dense
    (`weight_dense`) - the same logits, without the bytes saved."""

    def __init__(self, weight: torch.Tensor, group_size: int, kernel: str | None = None):
        super().__init__()
        from qfd.kernels import HAVE_TRITON, interpreting
        from qfd.kernels.int8_triton import dequantize_int8, quantize_int8

        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        self.dtype = weight.dtype
        q, scales = quantize_int8(weight, group_size, scale_dtype=weight.dtype)
        self.register_buffer("qweight", q.to(weight.device))
        self.register_buffer("scales", scales.to(weight.device))
        use_kernel = HAVE_TRITON and (weight.is_cuda or (interpreting() and kernel == "triton"))
        self.register_buffer("weight_dense", None if use_kernel else dequantize_int8(self.qweight, self.scales, weight.dtype))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        from qfd.kernels.int8_triton import dequantize_int8

        return dequantize_int8(self.qweight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from qfd.kernels.int8_triton import int8_mm_op
        from qfd.models.linear import linear

        if self.weight_dense is not None:
            return linear(x, self.weight_dense)
        return int8_mm_op(x, self.qweight, self.scales)


def _dense_head(model: torch.nn.Module, flag: str, group_size: int | None) -> tuple[torch.Tensor, int]:
    """The weight of `model.lm_head` and the group size to quantize it with, or a QfdError."""
    from qfd.errors import QfdError

    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Linear) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise QfdError(f"{flag} needs a dense LM head (nn.Linear); this model's lm_head is already quantized or missing")
    if head.bias is not None:
        raise QfdError(f"{flag} takes an LM head without a bias; this model's has one")
    group_size = group_size or head_group_size(weight.shape[1])
    if group_size is None or weight.shape[1] % group_size != 0:
        raise QfdError(f"{flag}: the head's input width {weight.shape[1]} is not a multiple of the group size {group_size or 32}")
    return weight, group_size


def quantize_head(model: torch.nn.Module, group_size: int | None = None, kernel: str | None = None, bits: int = 4) -> torch.nn.Module:
    """Replace `model.lm_head` (an nn.Linear) by its RTN quantization, on the head's device and
    dtype; returns the new head. bits 4: an Int4Linear (`kernel`: its CUDA INT4 kernel); bits 8:
    an `Int8Head` (`kernel` "triton": its kernel under Triton's interpreter too). `group_size`:
    default `head_group_size` of the head's width."""
    from qfd.quant.grid import rtn_quantize
    from qfd.quant.int4_linear import swap_int4_linears

    if bits not in (4, 8):
        raise ValueError(f"quantize_head: bits must be 4 or 8, not {bits}")
    weight, group_size = _dense_head(model, f"--int{bits}-head", group_size)
    if bits == 8:
        model.lm_head = Int8Head(weight, group_size, kernel=kernel)
        return model.lm_head
    qw = rtn_quantize(weight.detach().float(), group_size, scale_dtype=weight.dtype)
    swap_int4_linears(model, {"lm_head": qw}, kernel=kernel)
    return model.lm_head
