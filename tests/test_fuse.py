"""Fused same-input projections (qfd.models.fuse) compute what the separate linears compute."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qfd.kernels import int4_layout, int4_triton
from qfd.models.fuse import fuse_projections
from qfd.models.linear import Linear
from qfd.models.loading import load_target
from qfd.quant.grid import rtn_quantize
from qfd.quant.int4_linear import Int4Linear, swap_int4_linears
from tests.tiny import make_tiny_checkpoint

ATOL = 1e-5
MEMBERS = ("gate_proj", "up_proj", "q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


@pytest.fixture(autouse=True)
def _fusion_on(monkeypatch):
    monkeypatch.delenv("QFD_FUSE", raising=False)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    """The shared tiny checkpoints, plus a llama with q/k/v/o and MLP biases."""
    biased = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("fuse") / "llama_bias", attention_bias=True, mlp_bias=True)
    return {**tiny_checkpoints, "llama_bias": biased}


def _unfused(directory):
    return load_target(directory, tokenizer=False, fuse=False)[0]


def _ids(length, batch=1, seed=0):
    return torch.randint(0, 512, (batch, length), generator=torch.Generator().manual_seed(seed))


def _linears(model) -> int:
    return sum(isinstance(m, (nn.Linear, Int4Linear)) for m in model.modules())


def _has_members(model) -> bool:
    return any(hasattr(m, name) for m in model.modules() for name in MEMBERS)


@torch.no_grad()
def _assert_same_outputs(model, fused):
    """Full forward; and a cached prefill, a 1-token decode and a 16-token verify."""
    ids = _ids(23, batch=2)
    torch.testing.assert_close(fused(ids).logits, model(ids).logits, atol=ATOL, rtol=0)
    caches = model.new_cache(64), fused.new_cache(64)
    for chunk in (_ids(11, seed=1), _ids(1, seed=2), _ids(16, seed=3)):
        want, got = model(chunk, caches[0]).logits, fused(chunk, caches[1]).logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama_bias", "qwen3", "qwen3_5"])
def test_fused_dense_model_matches_unfused(checkpoints, family):
    model = _unfused(checkpoints[family])
    layers = model.config.num_hidden_layers
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * layers  # the MLP and the token mixer of every layer
    assert fuse_projections(fused) == 0  # already fused
    # per layer: gate/up -> 1, and q/k/v -> 1 or the four GDN in_proj_* -> 1
    gdn = sum(kind == "linear_attention" for kind in model.config.layer_types)
    assert _linears(model) - _linears(fused) == layers + 2 * (layers - gdn) + 3 * gdn
    assert _has_members(model) and not _has_members(fused)
    layer = fused.model.layers[0]
    assert type(layer.mlp.gate_up_proj) is Linear and layer.mlp.gate_up_sizes == (model.config.intermediate_size,) * 2
    if family == "llama_bias":
        assert layer.self_attn.qkv_proj.bias is not None and layer.mlp.gate_up_proj.bias is not None
    _assert_same_outputs(model, fused)


def _quantize(model, kernel=None, symmetric=True, only=None):
    """RTN INT4 (group 32) of the decoder layers' linears (or only those named in `only`)."""
    qweights = {
        name: rtn_quantize(m.weight.detach(), 32, symmetric=symmetric)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.startswith("model.layers.") and (only is None or name in only)
    }
    return swap_int4_linears(model, qweights, kernel=kernel)


@pytest.mark.parametrize(
    "family, kernel, symmetric",
    [("qwen3_5", "triton", True), ("qwen3_5", "triton", False), ("llama_bias", "triton", False), ("qwen3_5", None, False), ("llama_bias", None, True)],
)
def test_fused_int4_model_matches_unfused(checkpoints, family, kernel, symmetric):
    """kernel "triton": the Triton layout (on a CPU its float32 reference); None: a float32
    CPU Int4Linear keeps the dequantized weight (mode "dequant")."""
    model = _quantize(_unfused(checkpoints[family]), kernel, symmetric)
    mode = "triton" if kernel else "dequant"
    assert {m.mode for m in model.modules() if isinstance(m, Int4Linear)} == {mode}
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.config.num_hidden_layers
    assert not _has_members(fused)
    for m in fused.model.layers.modules():
        assert not isinstance(m, nn.Linear)
        if isinstance(m, Int4Linear):
            assert m.mode == mode
    gate_up = fused.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, Int4Linear) and gate_up.out_features == 2 * model.config.intermediate_size
    if kernel:
        parts = model.model.layers[0].mlp.gate_proj, model.model.layers[0].mlp.up_proj
        # a gated pair: gate and up interleaved column by column, silu(gate) * up from the product
        assert gate_up.gated and "gated" in repr(gate_up)
        assert torch.equal(gate_up.triton_qweight, int4_layout.interleave_columns(parts[0].triton_qweight, parts[1].triton_qweight))
        assert (gate_up.triton_zeros is None) == symmetric
        assert not gate_up.triton_counters.any() and gate_up.triton_counters.shape == parts[0].triton_counters.shape
    else:
        assert not gate_up.gated
    _assert_same_outputs(model, fused)


def test_qfd_gated_mlp_0_keeps_gate_and_up_side_by_side(checkpoints, monkeypatch):
    """QFD_GATED_MLP=0: the MLP's INT4 gate/up pair concatenates as the other groups do and the
    MLP applies its activation itself - the same outputs."""
    monkeypatch.setenv("QFD_GATED_MLP", "0")
    model = _quantize(_unfused(checkpoints["qwen3_5"]), "triton", False)
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    gate_up = fused.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, Int4Linear) and not gate_up.gated and fused.model.layers[0].mlp.gate_up_sizes == (model.config.intermediate_size,) * 2
    _assert_same_outputs(model, fused)


def test_groups_of_mixed_kinds_stay_unfused(checkpoints):
    """One member INT4, the others dense: that group keeps its separate linears."""
    model = _unfused(checkpoints["qwen3_5"])
    first_attn = next(i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention")
    mixed = {"model.layers.0.mlp.gate_proj", "model.layers.0.linear_attn.in_proj_b", f"model.layers.{first_attn}.self_attn.k_proj"}
    _quantize(model, only=mixed)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.config.num_hidden_layers - 3
    layer0, attn = fused.model.layers[0], fused.model.layers[first_attn].self_attn
    assert layer0.mlp.gate_up_proj is None and isinstance(layer0.mlp.gate_proj, Int4Linear) and type(layer0.mlp.up_proj) is Linear
    assert layer0.linear_attn.in_proj is None and isinstance(layer0.linear_attn.in_proj_b, Int4Linear)
    assert attn.qkv_proj is None and isinstance(attn.k_proj, Int4Linear)
    assert fused.model.layers[1].mlp.gate_up_proj is not None  # the other groups fuse
    _assert_same_outputs(model, fused)


def test_what_cannot_be_concatenated_is_refused():
    torch.manual_seed(0)
    qw = [rtn_quantize(torch.randn(48, 64), 32) for _ in range(2)]
    # torch's CPU int4 kernel (bf16): a tile-packed layout that does not cut along the outputs
    cpu_int4 = [Int4Linear(q, dtype=torch.bfloat16) for q in qw]
    assert {m.mode for m in cpu_int4} == {"cpu_int4"} and Int4Linear.concatenated(cpu_int4) is None
    # different modes, group sizes, or a bias on one part only
    triton, dequant = Int4Linear(qw[0], kernel="triton"), Int4Linear(qw[1])
    assert Int4Linear.concatenated([triton, dequant]) is None
    assert Int4Linear.concatenated([dequant, Int4Linear(rtn_quantize(torch.randn(48, 64), 64))]) is None
    qw_bias = rtn_quantize(torch.randn(48, 64), 32)
    qw_bias.bias = torch.randn(48)
    assert Int4Linear.concatenated([dequant, Int4Linear(qw_bias)]) is None
    # dense: a bias on one only, another dtype
    from qfd.models.fuse import concatenated

    assert concatenated([Linear(64, 8), Linear(64, 8, bias=False)]) is None
    assert concatenated([Linear(64, 8), Linear(64, 8).bfloat16()]) is None
    assert concatenated([Linear(64, 8), Linear(32, 8)]) is None
    # what fuses computes the parts' outputs side by side (bias included)
    both = Int4Linear.concatenated([Int4Linear(qw_bias, kernel="triton"), Int4Linear(qw_bias, kernel="triton")])
    x = torch.randn(3, 64)
    part = Int4Linear(qw_bias, kernel="triton")(x)
    torch.testing.assert_close(both(x), torch.cat([part, part], -1), atol=ATOL, rtol=0)


def test_load_target_fuses_unless_asked_not_to(tiny_checkpoints, monkeypatch):
    directory = tiny_checkpoints["qwen3_5"]
    fused = load_target(directory, tokenizer=False)[0]
    assert not _has_members(fused) and fused.model.layers[0].linear_attn.in_proj is not None
    assert fused.model.layers[0].linear_attn.in_proj_sizes[2:] == (fused.config.linear_num_value_heads,) * 2
    kept = load_target(directory, tokenizer=False, fuse=False)[0]
    assert _has_members(kept) and kept.model.layers[0].linear_attn.in_proj is None
    monkeypatch.setenv("QFD_FUSE", "0")
    off = load_target(directory, tokenizer=False)[0]
    assert _has_members(off) and _linears(off) == _linears(kept)
    assert fuse_projections(off) == 0
    # the unfused tree keeps transformers' state-dict names (what checkpoints are loaded by)
    assert off.state_dict().keys() == kept.state_dict().keys()
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in kept.state_dict()


def test_fused_int4_keeps_the_loaders_dtype_probe():
    """INT4 loaders give each swapped linear an empty `weight` for code that asks its dtype."""
    from qfd.quant.int4_load import give_dtype_probe

    parts = [Int4Linear(rtn_quantize(torch.randn(16, 64), 32)) for _ in range(3)]
    for part in parts:
        give_dtype_probe(part, "cpu", torch.float32)
    fused = Int4Linear.concatenated(parts)
    assert fused.weight.dtype == torch.float32 and fused.weight.numel() == 0
    assert set(fused.state_dict()) == {"weight_dense"}  # not persistent, as the parts'


def test_fused_drafter_drafts_the_same(tmp_path):
    """load_drafter(fuse=True): k/v and gate/up stacked, the same draft logits (context append
    and block), and the plain load keeps the separate modules (training and GPTQ read them)."""
    from qfd.models.drafter_io import load_drafter
    from tests.test_draft_swa import make_drafter_dir, run_drafter

    directory = make_drafter_dir(tmp_path / "drafter")
    plain, fused = load_drafter(directory), load_drafter(directory, fuse=True)
    assert _linears(fused) == _linears(plain) - 2 * plain.cfg.num_hidden_layers
    assert all(layer.self_attn.kv_proj is not None and not hasattr(layer.mlp, "gate_proj") for layer in fused.layers)
    assert all(hasattr(layer.self_attn, "k_proj") and layer.self_attn.kv_proj is None for layer in plain.layers)
    torch.manual_seed(2)
    embed, head = nn.Embedding(512, 64), nn.Linear(64, 512, bias=False)
    taps = torch.randn(1, 11, 2 * 64)
    with torch.no_grad():
        torch.testing.assert_close(run_drafter(fused, taps, 5, embed, head), run_drafter(plain, taps, 5, embed, head), rtol=1e-5, atol=1e-5)


def test_a_gated_pair_asks_the_kernel_for_the_activation_at_every_row_count(checkpoints, monkeypatch):
    """The gate/up product stores silu(gate) * up itself at 1, 16 and 32 rows; past the kernel's
    row limit (the dequant path) torch applies it after the product - the same result either way."""
    from qfd.quant import int4_linear

    model = _quantize(_unfused(checkpoints["qwen3_5"]), "triton", False)
    mlp = model.model.layers[0].mlp
    pair = int4_linear.Int4Linear.gated_pair(mlp.gate_proj, mlp.up_proj)
    asked = []
    real_op = int4_triton.int4_mm_op
    monkeypatch.setattr(int4_triton, "int4_mm_op", lambda *args: asked.append(args[-1]) or real_op(*args))
    limit = int4_linear.KERNEL_MAX_ROWS["triton"]
    for rows, in_kernel in ((1, [True]), (16, [True]), (32, [True]), (limit + 1, [])):
        x = torch.randn(rows, model.config.hidden_size)
        want = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        asked.clear()
        torch.testing.assert_close(pair(x), want, atol=1e-5, rtol=1e-5)
        assert asked == in_kernel, rows
