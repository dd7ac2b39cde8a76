"""Fuse the runtime target's same-input projections into one linear each (fewer kernel launches).

At batch 1 on a GPU a decode step is launch-bound: every linear is one kernel of ~4-9 us even
when tiny. Several of a layer's linears read the same input, so their weights stack along the
output dim into one module whose output `torch.split` cuts back apart:

    MLP            gate_proj, up_proj                                -> mlp.gate_up_proj
    Attention      q_proj, k_proj, v_proj                            -> self_attn.qkv_proj
    GatedDeltaNet  in_proj_qkv, in_proj_z, in_proj_b, in_proj_a      -> linear_attn.in_proj
    drafter MLP    gate_proj, up_proj                                -> mlp.gate_up_proj
    drafter attn   k_proj, v_proj                                    -> self_attn.kv_proj

    fuse_projections(model)   # after loading: state-dict names stay transformers' until here

Fusion is for inference only and happens after the weights are loaded (the checkpoint's names
are the unfused ones); the member modules are deleted to free their memory, the parent keeps
the fused module and the split sizes. A group fuses when all its members are the same kind:
dense `nn.Linear`/qfd `Linear` (-> one qfd `Linear`, its CPU few-row path included), or
`Int4Linear` in mode "dequant" or "triton" (`Int4Linear.concatenated`); same in_features,
dtype and device. Anything else (tinygemm INT4 layouts, mixed kinds) is left unfused, silently:
the unfused forward is always there.

A gate/up pair of Triton-mode `Int4Linear`s fuses further (`Int4Linear.gated_pair`): its
columns interleave gate and up, the module returns silu(gate) * up, and the MLP's forward passes
that straight to down_proj. The product's kernel stores the activation as it writes each tile
(no activation kernel, no [rows, 2 x intermediate] round trip); where another kernel runs the
product (tinygemm, long prompts) torch applies it after. QFD_GATED_MLP=0 keeps the plain
concatenation and the MLP's own activation.

`qfd.models.loading.load_target` fuses by default (`fuse=False` keeps the modules);
QFD_FUSE=0 in the environment turns fusion off everywhere (`fuse_projections` returns 0).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from qfd.models.drafter import DrafterAttention, DrafterMLP
from qfd.models.gdn import GatedDeltaNet
from qfd.models.linear import Linear
from qfd.models.target import MLP, Attention

# parent class -> (fused module attribute, split-sizes attribute, member attributes in output order)
GROUPS = {
    MLP: ("gate_up_proj", "gate_up_sizes", ("gate_proj", "up_proj")),
    Attention: ("qkv_proj", "qkv_sizes", ("q_proj", "k_proj", "v_proj")),
    GatedDeltaNet: ("in_proj", "in_proj_sizes", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    # the DFlash drafter (load_drafter(fuse=True)): its context append projects k/v without q
    DrafterMLP: ("gate_up_proj", "gate_up_sizes", ("gate_proj", "up_proj")),
    DrafterAttention: ("kv_proj", "kv_sizes", ("k_proj", "v_proj")),
}


def fusion_enabled() -> bool:
    """False when the environment says QFD_FUSE=0."""
    return os.environ.get("QFD_FUSE", "1").strip() != "0"


def gated_mlp_enabled() -> bool:
    """False when the environment says QFD_GATED_MLP=0 (module docstring)."""
    return os.environ.get("QFD_GATED_MLP", "1").strip() != "0"


def fuse_projections(model: nn.Module) -> int:
    """Fuse every fusable projection group of `model` in place; returns how many groups fused
    (0 under QFD_FUSE=0). Idempotent: a parent already fused is skipped."""
    if not fusion_enabled():
        return 0
    fused_groups = 0
    for parent in list(model.modules()):
        spec = GROUPS.get(type(parent))
        if spec is None:
            continue
        fused_name, sizes_name, members = spec
        if getattr(parent, fused_name, None) is not None or not all(hasattr(parent, m) for m in members):
            continue
        parts = [getattr(parent, m) for m in members]
        fused = gated_pair(parts) if fused_name == "gate_up_proj" and gated_mlp_enabled() else None
        fused = fused or concatenated(parts)
        if fused is None:
            continue
        setattr(parent, fused_name, fused)
        setattr(parent, sizes_name, tuple(p.out_features for p in parts))
        for m in members:
            delattr(parent, m)
        fused_groups += 1
    return fused_groups


def gated_pair(parts: list[nn.Module]) -> nn.Module | None:
    """One module returning silu(gate) * up for a gate/up pair of INT4 linears, or None."""
    from qfd.quant.int4_linear import Int4Linear

    if all(type(p) is Int4Linear for p in parts):
        return Int4Linear.gated_pair(*parts)
    return None


def concatenated(parts: list[nn.Module]) -> nn.Module | None:
    """One module whose output is the `parts`' outputs concatenated, or None if they cannot fuse."""
    from qfd.quant.int4_linear import Int4Linear

    if all(type(p) is Int4Linear for p in parts):
        return Int4Linear.concatenated(parts)
    # exact types: a subclass of nn.Linear may compute something else than x @ W.T + b
    if not all(type(p) in (nn.Linear, Linear) for p in parts):
        return None
    first = parts[0]
    same = {(p.in_features, p.weight.dtype, p.weight.device, p.bias is None) for p in parts}
    if len(same) != 1 or any(p.bias is not None and (p.bias.dtype, p.bias.device) != (first.bias.dtype, first.bias.device) for p in parts):
        return None
    with torch.device("meta"):  # no init of a weight about to be replaced
        fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None)
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=first.weight.requires_grad)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=first.bias.requires_grad)
    return fused.train(first.training)
