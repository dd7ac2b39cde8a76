"""qfd.models.linear.Linear: the CPU few-rows path (W @ x.T) equals F.linear, is taken where
it should be (and only there), and leaves nn.Linear's interface alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qfd.models import linear as qfd_linear
from qfd.models.linear import Linear


@pytest.fixture()
def spy(monkeypatch):
    """Counts the calls of the fast path and of F.linear made by Linear.forward."""
    calls = {"small": 0, "linear": 0}
    small, linear = qfd_linear.small_rows_linear, F.linear

    def counting_small(*args):
        calls["small"] += 1
        return small(*args)

    def counting_linear(*args):
        calls["linear"] += 1
        return linear(*args)

    monkeypatch.setattr(qfd_linear, "small_rows_linear", counting_small)
    monkeypatch.setattr(qfd_linear.F, "linear", counting_linear)
    return calls


def _input(rows: int, features: int, three_d: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g)
    # 3-D: [2, rows/2, in] for even rows, else [1, rows, in]; the path sees the flattened rows
    return (x.view(2, rows // 2, features) if rows % 2 == 0 else x.view(1, rows, features)) if three_d else x


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("three_d", [False, True])
def test_fast_path_equals_f_linear_for_1_to_20_rows(bias, three_d, monkeypatch):
    monkeypatch.setattr(qfd_linear, "SMALL_ROWS", 20)  # the path itself, at every row count
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias)
    for rows in range(1, 21):
        x = _input(rows, 96, three_d, seed=rows)
        assert qfd_linear.use_small_rows(x, layer.weight)
        out, ref = layer(x), F.linear(x, layer.weight, layer.bias)
        assert out.shape == ref.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fast_path_taken_on_cpu_float32_up_to_the_threshold_only(spy):
    layer = Linear(64, 48)
    n = qfd_linear.SMALL_ROWS
    assert n >= 2, "the threshold turned the path (nearly) off"
    for rows in range(1, n + 1):
        layer(torch.randn(1, rows, 64))
    assert spy == {"small": n, "linear": 0}
    layer(torch.randn(1, n + 1, 64))
    layer(torch.randn(n + 1, 64))
    assert spy == {"small": n, "linear": 2}
    layer.to(torch.bfloat16)(torch.randn(1, 2, 64, dtype=torch.bfloat16))  # bf16: oneDNN, left alone
    assert spy == {"small": n, "linear": 3}


def test_threshold_zero_turns_the_path_off(spy, monkeypatch):
    monkeypatch.setattr(qfd_linear, "SMALL_ROWS", 0)
    Linear(64, 48)(torch.randn(1, 1, 64))
    assert spy == {"small": 0, "linear": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_keeps_f_linear(spy):
    Linear(64, 48, device="cuda")(torch.randn(1, 2, 64, device="cuda"))
    assert spy == {"small": 0, "linear": 1}


def test_gradients_match_f_linear():
    torch.manual_seed(0)
    layer = Linear(32, 24)
    x = torch.randn(1, 3, 32, requires_grad=True)
    layer(x).square().sum().backward()
    grads = (x.grad, layer.weight.grad, layer.bias.grad)
    x.grad = layer.weight.grad = layer.bias.grad = None
    F.linear(x, layer.weight, layer.bias).square().sum().backward()
    for got, want in zip(grads, (x.grad, layer.weight.grad, layer.bias.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_is_an_nn_linear_with_its_state_dict():
    layer = Linear(8, 4)
    assert isinstance(layer, nn.Linear)
    assert list(layer.state_dict()) == list(nn.Linear(8, 4).state_dict()) == ["weight", "bias"]
    one_d = torch.randn(8)
    torch.testing.assert_close(layer(one_d), F.linear(one_d, layer.weight, layer.bias), atol=1e-6, rtol=1e-6)


def test_models_use_it_and_a_decode_step_takes_it(tiny_checkpoints, spy, monkeypatch):
    """Every dense linear of the target (lm_head, attention, MLP, Gated DeltaNet) and of the
    drafter is a Linear, and a 1-token decode goes through the fast path, with the logits of
    the F.linear forward."""
    monkeypatch.setattr(qfd_linear, "SMALL_ROWS", 8)
    from qfd.models.drafter import DFlashDrafter, DFlashConfig
    from qfd.models.loading import load_target

    target, _ = load_target(tiny_checkpoints["qwen3_5"], tokenizer=False)
    names = [name for name, m in target.named_modules() if isinstance(m, nn.Linear)]
    assert "lm_head" in names and any(".linear_attn." in n for n in names) and any(".self_attn." in n for n in names)
    assert all(type(m) is Linear for m in target.modules() if isinstance(m, nn.Linear))
    drafter = DFlashDrafter(DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=64, target_layer_ids=(1, 2), mask_token_id=63, num_target_layers=4, block_size=4))
    assert all(type(m) is Linear for m in drafter.modules() if isinstance(m, nn.Linear))

    cache = target.new_cache(32)
    with torch.inference_mode():
        prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])  # 10 rows > 8: F.linear
        target(prompt, cache)
        ref_cache = target.new_cache(32)
        target(prompt, ref_cache)
        assert spy["small"] == 0
        out = target(torch.tensor([[15]]), cache)
        assert spy["small"] > 0 and spy["small"] == len(names)  # every linear once in a decode
        # and the decode equals the plain F.linear forward of the same step
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(qfd_linear, "SMALL_ROWS", 0)
            ref = target(torch.tensor([[15]]), ref_cache)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
