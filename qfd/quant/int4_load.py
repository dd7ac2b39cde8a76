"""Load an INT4 checkpoint directory into an already-built module (used for the INT4 drafter).

`load_int4_module(module, directory)` reads the directory with `qfd.quant.formats.load_quantized`
(compressed-tensors pack-quantized / GPTQ v1 / AWQ), loads its non-quantized tensors (norms)
into `module`, and swaps every quantized nn.Linear for an `Int4Linear` (or, with
`dequantize=True`, writes the dequantized weight into the dense linear instead, e.g. for
fine-tuning). Module paths in the checkpoint must match `module.named_modules()`.

A drafter loader calls it after building the model from config.json:

    drafter = DFlashDrafter(cfg)
    load_int4_module(drafter, directory, device=device, dtype=dtype)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qfd.errors import QfdError


def load_int4_module(module: nn.Module, directory: str | Path, device="cpu", dtype: torch.dtype = torch.float32, dequantize: bool = False) -> nn.Module:
    """Fill `module` from the INT4 directory; returns it on `device`/`dtype`, eval mode."""
    from qfd.quant.formats import load_quantized
    from qfd.quant.grid import dequantize as dequantize_weight

    ckpt = load_quantized(directory)
    modules = dict(module.named_modules())
    not_linear = [p for p in ckpt.qweights if not isinstance(modules.get(p), nn.Linear)]
    if not_linear:
        raise QfdError(f"{directory}: quantized tensors {not_linear[:3]} name no linear layer of the model; the checkpoint does not match its config")
    state = dict(ckpt.other)
    if dequantize:
        for path, qw in ckpt.qweights.items():
            state[f"{path}.weight"] = dequantize_weight(qw, torch.float32)
    expected = set(module.state_dict())
    if not dequantize:
        expected -= {f"{p}.weight" for p in ckpt.qweights}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    # A linear's bias may live with its QuantizedWeight instead of in `other`.
    missing = [m for m in missing if not (m.endswith(".bias") and m[: -len(".bias")] in ckpt.qweights)]
    if missing or unexpected:
        raise QfdError(f"{directory}: INT4 tensors do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    module.load_state_dict(state, strict=False)
    module.to(device=device, dtype=dtype)
    if not dequantize:
        from qfd.quant.int4_linear import swap_int4_linears

        swap_int4_linears(module, ckpt.qweights)
        for path in ckpt.qweights:
            give_dtype_probe(dict(module.named_modules())[path], device, dtype)
    return module.eval()


def give_dtype_probe(linear: nn.Module, device, dtype: torch.dtype) -> None:
    """Int4Linear has no `.weight`; code that asks a linear for its dtype/device
    (`layer.weight.dtype`) gets an empty, non-persistent stand-in that follows `.to()`."""
    if getattr(linear, "weight", None) is None:
        linear.register_buffer("weight", torch.empty(0, device=device, dtype=dtype), persistent=False)
