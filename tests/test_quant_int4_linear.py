"""Int4Linear executes INT4 and equals the dequantized matmul."""

from __future__ import annotations

import pytest
import torch

from qfd.models.linear import linear
from qfd.quant.grid import dequantize, rtn_quantize
from qfd.quant.int4_linear import KERNEL_MAX_ROWS, Int4Linear, swap_int4_linears


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS["cpu_int4"] + 5])
def test_int4_linear_equals_dequantized_matmul(symmetric, group_size, rows):
    torch.manual_seed(group_size)
    qw = rtn_quantize(torch.randn(96, 256), group_size, symmetric=symmetric)
    qw.bias = torch.randn(96)
    layer = Int4Linear(qw, dtype=torch.bfloat16)
    assert layer.mode == "cpu_int4"  # the CPU kernel takes these shapes (bf16 activations)
    x = torch.randn(2, rows, 256).bfloat16()
    ref = torch.nn.functional.linear(x.float(), dequantize(qw), qw.bias)
    # bf16 output (8 bits of mantissa) of an fp32-accumulated product
    torch.testing.assert_close(layer(x).float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_float32_on_the_cpu_keeps_the_dequantized_weight():
    """torch's CPU int4 kernel is 12x slower than a dense fp32 matmul for fp32 activations:
    a float32 layer stores w_hat and is exact."""
    qw = rtn_quantize(torch.randn(96, 256), 64)
    layer = Int4Linear(qw, dtype=torch.float32)
    for rows in (1, 3, 20):  # qfd's dense Linear math on w_hat, its few-row CPU path included
        x = torch.randn(rows, 256)
        assert layer.mode == "dequant" and torch.equal(layer(x), linear(x, dequantize(qw)))


def test_dequant_fallback_is_exact():
    qw = rtn_quantize(torch.randn(8, 64), 32)
    layer = Int4Linear(qw, allow_kernel=False)
    x = torch.randn(3, 64)
    assert layer.mode == "dequant" and torch.equal(layer(x), linear(x, dequantize(qw)))


def test_swap_replaces_linears_in_place(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()
    qweights = {name: rtn_quantize(m.weight.detach(), 32) for name, m in model.named_modules() if name.endswith(("q_proj", "down_proj"))}
    ids = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        for name, qw in qweights.items():
            model.get_submodule(name).weight.copy_(dequantize(qw))
        dense = model(ids).logits
        swap_int4_linears(model, qweights)
        assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), Int4Linear)
        torch.testing.assert_close(model(ids).logits, dense, rtol=1e-4, atol=1e-4)
