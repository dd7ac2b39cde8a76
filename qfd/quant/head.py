"""INT4 LM head at load time (`--int4-head`): round-to-nearest, symmetric, group 128 (64 or 32
where 128 does not divide the hidden size).

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

A tied head keeps the embedding table dense for the lookups; the head gets its own INT4 copy.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128
GROUP_FALLBACKS = (128, 64, 32)  # for widths 128 does not divide (SmolLM2-135M: 576 -> 64)


def head_group_size(width: int) -> int | None:
    """The group size `quantize_head` uses for a head `width` wide: 128, else 64, else 32 (None: none divides)."""
    return next((g for g in GROUP_FALLBACKS if width % g == 0), None)


def quantize_head(model: torch.nn.Module, group_size: int | None = None, kernel: str | None = None) -> torch.nn.Module:
    """Replace `model.lm_head` (an nn.Linear) by an Int4Linear of its RTN INT4 weight, on the
    head's device and dtype; returns the new head. `group_size`: default `head_group_size` of
    the head's width. `kernel`: the CUDA INT4 kernel (Int4Linear)."""
    from qfd.errors import QfdError
    from qfd.quant.grid import rtn_quantize
    from qfd.quant.int4_linear import swap_int4_linears

    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Linear) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise QfdError("--int4-head needs a dense LM head (nn.Linear); this model's lm_head is already quantized or missing")
    group_size = group_size or head_group_size(weight.shape[1])
    if group_size is None or weight.shape[1] % group_size != 0:
        raise QfdError(f"--int4-head: the head's input width {weight.shape[1]} is not a multiple of the group size {group_size or 32}")
    qw = rtn_quantize(weight.detach().float(), group_size, scale_dtype=weight.dtype)
    swap_int4_linears(model, {"lm_head": qw}, kernel=kernel)
    return model.lm_head
