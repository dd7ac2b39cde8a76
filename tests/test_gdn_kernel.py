"""The fused gated-delta step (`qfd::gated_delta_step`) and the split attention-values product.

On CI (no Triton) the op runs its torch reference: these tests check the op's in-place contract
(start, history, state) and that GDNState gives the same results through it. The Triton kernel
itself runs on a GPU or under TRITON_INTERPRET=1 with Triton installed (skipped on CI);
bench_steps.py --reference-kernels compares it with the torch recurrence on the H200."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from qfd.kernels import gdn_triton, runs_on
from qfd.models.gdn import prepare_qk, recurrent_gated_delta
from qfd.models.target import VALUE_CHUNK, weighted_values


def step_inputs(B=1, T=5, H=4, dk=32, dv=48, seed=0):
    torch.manual_seed(seed)
    q, k = prepare_qk(torch.randn(B, T, H, dk), torch.randn(B, T, H, dk))
    v = torch.randn(B, T, H, dv)
    g = -torch.rand(B, T, H)
    beta = torch.rand(B, T, H)
    state = torch.randn(B, H, dk, dv)
    return q, k, v, g, beta, state


def check_step(device):
    q, k, v, g, beta, state = (x.to(device) for x in step_inputs())
    history = torch.zeros(1, 16, *state.shape[1:], device=device)
    expected_history = torch.zeros_like(history)
    expected_out, expected_final = recurrent_gated_delta(q, k, v, g, beta, state, history=expected_history)
    live, start = state.clone(), torch.zeros_like(state)
    out = gdn_triton.gated_delta_step(q, k, v, g, beta, live, start, history)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(live, expected_final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(start, state)
    torch.testing.assert_close(history[:, :5], expected_history[:, :5], rtol=1e-5, atol=1e-5)


def test_the_op_saves_the_start_writes_the_history_and_the_final_state():
    check_step("cpu")


def test_the_op_compiles_with_its_mutations():
    q, k, v, g, beta, state = step_inputs(T=2)
    history = torch.zeros(1, 4, *state.shape[1:])
    live, start = state.clone(), torch.zeros_like(state)
    fn = torch.compile(lambda *a: gdn_triton.gated_delta_step(*a), fullgraph=True, backend="aot_eager")
    out = fn(q, k, v, g, beta, live, start, history)
    expected, final = recurrent_gated_delta(q, k, v, g, beta, state)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(live, final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(start, state)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the Triton kernel needs Triton and a GPU, or TRITON_INTERPRET=1 (not on CI)",
)
def test_kernel_matches_the_torch_recurrence():
    assert runs_on(torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu"))
    check_step("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("S", [4 * VALUE_CHUNK, 5 * VALUE_CHUNK + 37])
def test_split_values_equal_the_single_product(S):
    torch.manual_seed(0)
    probs = torch.rand(1, 2, 3, S).softmax(-1)
    v = torch.randn(1, 2, S, 16)
    torch.testing.assert_close(weighted_values(probs, v, split=True), probs @ v, rtol=1e-5, atol=1e-5)
