"""The fused gated-delta step (`qfd::gated_delta_step`, and `qfd::gated_delta_conv_step` with the
conv, SiLU, q/k normalisation and gates folded in) and the split attention-values product.

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
from qfd.models.gdn import conv_and_gates, prepare_qk, recurrent_gated_delta
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


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the Triton kernel needs Triton and a GPU, or TRITON_INTERPRET=1 (not on CI)",
)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
def test_kernel_matches_the_torch_recurrence():
    assert runs_on(torch.zeros(1, device=KERNEL_DEVICE))
    check_step(KERNEL_DEVICE)


def conv_step_inputs(dtype, device, B=2, T=5, k_heads=2, dk=32, H=4, dv=48, kc=4, seed=0, channels_last=False):
    """Raw layer inputs; a and b are strided views of one projection output, as after fusion.
    channels_last: the window [B, C, K-1+T] a transposed view of [B, K-1+T, C] memory, as
    `GatedDeltaNet._window` builds it through a cache."""
    torch.manual_seed(seed)
    C = 2 * k_heads * dk + H * dv
    window = torch.randn(B, kc - 1 + T, C).to(dtype).transpose(1, 2) if channels_last else torch.randn(B, C, kc - 1 + T).to(dtype)
    conv_weight = (torch.randn(C, 1, kc) * 0.5).to(dtype)
    ab = torch.randn(B, T, 2 * H + 3).to(dtype)
    b, a = ab[..., :H], ab[..., H : 2 * H]
    A_log, dt_bias = torch.randn(H).to(dtype), torch.randn(H).to(dtype)
    state = torch.randn(B, H, dk, dv)
    return [x.to(device) for x in (window, conv_weight, a, b, A_log, dt_bias, state)], (k_heads, dk, H, dv)


def check_conv_step(device, dtype, tol, T=5, channels_last=False):
    (window, conv_weight, a, b, A_log, dt_bias, state), dims = conv_step_inputs(dtype, device, T=T, channels_last=channels_last)
    B, C, W = window.shape
    q, k, v, g, beta = conv_and_gates(window.cpu(), conv_weight.cpu(), a.cpu(), b.cpu(), A_log.cpu(), dt_bias.cpu(), dims, dtype)
    expected_history = torch.zeros(B, max(16, T), *state.shape[1:])
    expected_out, expected_final = recurrent_gated_delta(q, k, v, g, beta, state.cpu(), history=expected_history)
    live, start = state.clone(), torch.zeros_like(state)
    history = torch.zeros(B, max(16, T), *state.shape[1:], device=device)
    conv_state = torch.zeros(B, C, conv_weight.shape[-1] - 1, dtype=dtype, device=device)
    out = gdn_triton.gated_delta_conv_step(window, conv_weight, a, b, A_log, dt_bias, live, start, history, conv_state, dims[0])
    torch.testing.assert_close(out.cpu(), expected_out, rtol=tol, atol=tol)
    torch.testing.assert_close(live.cpu(), expected_final, rtol=tol, atol=tol)
    torch.testing.assert_close(start, state)
    # every position's state but the last (the state itself: the token loop skips that store)
    torch.testing.assert_close(history[:, : T - 1].cpu(), expected_history[:, : T - 1], rtol=tol, atol=tol)
    assert torch.equal(conv_state, window[..., W - conv_state.shape[-1] :])


def test_the_conv_op_equals_conv_and_gates_then_the_recurrence():
    check_conv_step("cpu", torch.float32, 1e-5)


@needs_triton
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_conv_kernel_matches_the_torch_layer_math(dtype, tol, channels_last, monkeypatch):
    """bf16: the kernel rounds where the module does (conv, SiLU, beta); sums differ in order.
    The window in either memory layout (the kernel reads it through its strides)."""
    from qfd import kernels

    monkeypatch.setattr(kernels, "_FAILED", set())
    check_conv_step(KERNEL_DEVICE, dtype, tol, channels_last=channels_last)
    assert not kernels._FAILED  # the kernel ran (no torch fallback)


class RecordedLaunch:
    """kernel[grid] as the launcher writes it, noting the kernel's name in `launched`."""

    def __init__(self, name, kernel, launched):
        self.name, self.kernel, self.launched = name, kernel, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


def run_conv_kernel(prefetch, dtype, T, monkeypatch, channels_last=False):
    """The conv op's token-loop kernel with QFD_GDN_PREFETCH on or off on `conv_step_inputs`:
    (output, final state, start, history, conv state), the torch layer math's (output, final
    state, history), and which kernels launched (a kernel failure fails the test)."""
    from qfd import kernels

    monkeypatch.setattr(gdn_triton, "PREFETCH", prefetch)
    monkeypatch.setattr(kernels, "_FAILED", set())
    launched = []

    for name in ("_gated_delta_conv_kernel", "_gated_delta_conv_prefetch_kernel"):
        kernel = getattr(gdn_triton, name)
        # unwrap a previous call's recorder (a JITFunction has a `kernel` attribute of its own)
        monkeypatch.setattr(gdn_triton, name, RecordedLaunch(name, kernel.kernel if isinstance(kernel, RecordedLaunch) else kernel, launched))
    (window, conv_weight, a, b, A_log, dt_bias, state), dims = conv_step_inputs(dtype, KERNEL_DEVICE, T=T, channels_last=channels_last)
    B, C, W = window.shape
    q, k, v, g, beta = conv_and_gates(window.cpu(), conv_weight.cpu(), a.cpu(), b.cpu(), A_log.cpu(), dt_bias.cpu(), dims, dtype)
    expected_history = torch.zeros(B, 16, *state.shape[1:])
    expected_out, expected_final = recurrent_gated_delta(q, k, v, g, beta, state.cpu(), history=expected_history)
    start, history = torch.zeros_like(state), torch.zeros(B, 16, *state.shape[1:], device=KERNEL_DEVICE)
    conv_state = torch.zeros(B, C, conv_weight.shape[-1] - 1, dtype=dtype, device=KERNEL_DEVICE)
    out = gdn_triton.gated_delta_conv_step(window, conv_weight, a, b, A_log, dt_bias, state, start, history, conv_state, dims[0])
    assert not kernels._FAILED  # the kernel ran (no torch fallback)
    assert torch.equal(conv_state, window[..., W - conv_state.shape[-1] :])
    got = (out, state, start, history[:, : T - 1], conv_state)
    return got, (expected_out, expected_final, expected_history[:, : T - 1]), launched


@needs_triton
@pytest.mark.parametrize("T,channels_last", [(1, False), (3, False), (16, False), (1, True), (16, True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_prefetching_conv_kernel_equals_the_plain_token_loop(T, channels_last, dtype, tol, monkeypatch):
    """QFD_GDN_PREFETCH: the token loop with its loads issued ahead (gates of all tokens before
    the loop, token t+1's window columns during token t) matches the torch layer math as the
    plain loop does, and equals the plain loop itself (the same float32 ops: exactly under the
    interpreter; on a GPU the compiler may contract the two differently)."""
    plain, expected, plain_kernel = run_conv_kernel(False, dtype, T, monkeypatch, channels_last)
    ahead, _, ahead_kernel = run_conv_kernel(True, dtype, T, monkeypatch, channels_last)
    assert (plain_kernel, ahead_kernel) == (["_gated_delta_conv_kernel"], ["_gated_delta_conv_prefetch_kernel"])
    for got in (plain, ahead):
        out, final, _, history, _ = got
        for g, want in zip((out, final, history), expected):
            torch.testing.assert_close(g.cpu(), want, rtol=tol, atol=tol)
    exact = KERNEL_DEVICE == "cpu"
    for g, want in zip(ahead, plain):
        torch.testing.assert_close(g, want, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)
    assert not torch.equal(plain[1], plain[2])  # the state moved (not two untouched tensors)


@needs_triton
@pytest.mark.parametrize("T,channels_last", [(2, False), (5, False), (16, False), (20, False), (5, True), (16, True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_parallel_verify_kernel_matches_the_torch_layer_math(T, channels_last, dtype, tol, monkeypatch):
    """QFD_GDN_VERIFY=chunk: the step's tokens in the WY form (gdn_verify_triton) give the
    token-by-token recurrence's outputs, final state, rollback history and conv state, for
    steps padded to 16 and to 32 tokens."""
    from qfd import kernels
    from qfd.kernels import gdn_verify_triton

    monkeypatch.setattr(gdn_verify_triton, "CHUNK_VERIFY", True)
    monkeypatch.setattr(kernels, "_FAILED", set())
    launches = []
    real_launch = gdn_verify_triton.launch
    monkeypatch.setattr(gdn_verify_triton, "launch", lambda *args: launches.append(T) or real_launch(*args))
    assert gdn_verify_triton.takes(T)
    check_conv_step(KERNEL_DEVICE, dtype, tol, T=T, channels_last=channels_last)
    assert launches == [T] and not kernels._FAILED  # the parallel kernel ran (no torch fallback)


@pytest.mark.parametrize("S", [4 * VALUE_CHUNK, 5 * VALUE_CHUNK + 37])
def test_split_values_equal_the_single_product(S):
    torch.manual_seed(0)
    probs = torch.rand(1, 2, 3, S).softmax(-1)
    v = torch.randn(1, 2, S, 16)
    torch.testing.assert_close(weighted_values(probs, v, split=True), probs @ v, rtol=1e-5, atol=1e-5)


def test_a_kernel_that_fails_warns_once_then_uses_its_fallback(monkeypatch):
    from qfd import kernels

    monkeypatch.setattr(kernels, "_FAILED", set())
    calls = []

    def broken():
        calls.append("kernel")
        raise RuntimeError("PTX too new")

    with pytest.warns(RuntimeWarning, match="kernel demo failed"):
        assert kernels.launch_or_fallback("demo", broken, lambda: "reference") == "reference"
    assert kernels.launch_or_fallback("demo", broken, lambda: "reference") == "reference"
    assert calls == ["kernel"]  # not retried
    assert kernels.launch_or_fallback("other", lambda: "kernel", lambda: "reference") == "kernel"


def check_tree_step(device):
    """The tree op against each node's path run as a plain sequence by the torch recurrence."""
    from qfd.models.gdn import tree_structure
    from qfd.tree import build_tree

    g_ = torch.Generator().manual_seed(1)
    tree = build_tree(0, torch.zeros(4, 3, dtype=torch.long), torch.randn(4, 3, generator=g_).log_softmax(-1).sort(-1, descending=True).values, 9)
    parents, _ = tree_structure(tree.ancestor_mask(), 4)
    assert parents.tolist() == list(tree.parents)
    assert any(p != i - 1 for i, p in enumerate(tree.parents) if i > 0)  # branches: the kernel reloads a state
    q, k, v, g, beta, state = (x.to(device) for x in step_inputs(B=2, T=tree.size, seed=3))
    history = torch.zeros(2, 16, *state.shape[1:], device=device)
    out = gdn_triton.gated_delta_tree_step(q, k, v, g, beta, state, history, parents.to(device))
    for node in range(tree.size):
        path = torch.tensor(tree.path_to(node))
        expected, final = recurrent_gated_delta(*(x[:, path] for x in (q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu())), state.cpu())
        torch.testing.assert_close(out[:, node].cpu(), expected[:, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(history[:, node].cpu(), final, rtol=1e-5, atol=1e-5)


def test_the_tree_op_continues_each_node_from_its_parent():
    check_tree_step("cpu")  # on CI: the torch reference


@needs_triton
def test_tree_kernel_matches_the_torch_recurrence_along_every_path():
    assert runs_on(torch.zeros(1, device=KERNEL_DEVICE))
    check_tree_step(KERNEL_DEVICE)


@needs_triton
def test_parallel_tree_kernel_matches_the_torch_recurrence_along_every_path(monkeypatch):
    """QFD_GDN_VERIFY=chunk: a tree's nodes in the WY form over each node's ancestors equal
    each path run token by token (outputs and every node's state), and that kernel ran."""
    from qfd import kernels
    from qfd.kernels import gdn_verify_triton

    monkeypatch.setattr(gdn_verify_triton, "CHUNK_VERIFY", True)
    monkeypatch.setattr(kernels, "_FAILED", set())
    launches = []
    real_launch = gdn_verify_triton.launch_tree
    monkeypatch.setattr(gdn_verify_triton, "launch_tree", lambda *args: launches.append(1) or real_launch(*args))
    check_tree_step(KERNEL_DEVICE)
    assert launches == [1] and not kernels._FAILED


@pytest.mark.parametrize("T,chunk", [(37, 16), (64, 16), (5, 32)])
def test_chunked_form_equals_the_recurrence(T, chunk, monkeypatch):
    """`chunked_gated_delta` (long prompts) gives the token-by-token recurrence's outputs and
    final state, whichever walks its chunks (torch loop here on CI; the kernel under Triton)."""
    from qfd.kernels import gdn_fla
    from qfd.models.gdn import chunked_gated_delta

    monkeypatch.setattr(gdn_fla, "BACKEND", "qfd")  # qfd's own form (flash-linear-attention's: below)

    q, k, v, g, beta, state = step_inputs(B=2, T=T, dk=32, dv=48)
    expected, final = recurrent_gated_delta(q, k, v, g, beta, state)
    out, got_final = chunked_gated_delta(q, k, v, g, beta, state, chunk_size=chunk)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_final, final, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("dv,C,dk", [(48, 16, 32), (16, 16, 64), (128, 64, 128)])
def test_chunk_recurrence_kernel_matches_the_torch_walk(dv, C, dk):
    """Small heads, and Qwen3.5-4B's (64-token chunks, 128 x 128 heads): the kernel itself
    runs (its fallback would fail the test), and equals the torch walk."""
    from qfd.kernels import gdn_chunk_triton
    from qfd.models.gdn import chunk_recurrence

    torch.manual_seed(1)
    B, H, n = 1, 2, 3
    shape = (B, H, n, C)
    kc, qs, ks = (torch.randn(*shape, dk, device=KERNEL_DEVICE) * 0.3 for _ in range(3))
    nv = torch.randn(*shape, dv, device=KERNEL_DEVICE)
    intra = torch.randn(*shape, C, device=KERNEL_DEVICE).tril() * 0.3
    decay = torch.rand(B, H, n, device=KERNEL_DEVICE)
    state = torch.randn(B, H, dk, dv, device=KERNEL_DEVICE)
    assert gdn_chunk_triton.kernel_takes(kc, nv)
    expected_out, expected_state = chunk_recurrence(kc, nv, qs, ks, intra, decay, state)
    out, final = gdn_chunk_triton.chunk_recurrence_triton(kc, nv, qs, ks, intra, decay, state, fallback=lambda: pytest.fail("kernel failed"))
    # float32 summed in another order: errors relative to the outputs' scale
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-5 * float(expected_out.abs().max()))
    torch.testing.assert_close(final, expected_state, rtol=1e-4, atol=1e-5 * float(expected_state.abs().max()))
    assert not torch.equal(final, state)  # the input state is not written


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-linear-attention runs on a GPU")
def test_flash_linear_attention_prefill_equals_the_float32_recurrence():
    """Where flash-linear-attention is installed, a long prompt's GDN goes through it: at
    Qwen3.5-4B's head sizes (128 x 128, 64-token chunks, 200 tokens) its outputs and final state
    equal the float32 recurrence's to 16-bit-input accuracy, from a non-zero state."""
    from qfd.kernels import gdn_fla
    from qfd.models.gdn import chunked_gated_delta

    if not gdn_fla.installed():
        pytest.skip("flash-linear-attention is not installed")
    q, k, v, g, beta, state = (t.cuda() for t in step_inputs(B=1, T=200, H=4, dk=128, dv=128, seed=3))
    v = v.to(torch.bfloat16)
    expected, final = recurrent_gated_delta(q, k, v, g, beta, state)
    from qfd import kernels

    with torch.inference_mode():
        assert gdn_fla.takes(q)
        out, got_final = chunked_gated_delta(q, k, v, g, beta, state)
    assert not kernels._FAILED  # the package's kernels ran (no fallback to qfd's form)
    for got, want in ((out, expected), (got_final, final)):
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 3e-2 * scale, float((got - want).abs().max()) / scale
    assert not torch.equal(got_final, state)


def test_static_caches_on_cuda_hold_whole_value_chunks():
    """On CUDA a static cache's length is rounded up to whole VALUE_CHUNKs, so the split values
    product reads V in place (a partial chunk made torch.compile copy V every step); the CPU
    keeps the exact length."""
    from qfd.models.target import static_cache_len

    assert static_cache_len(8448 + 300, torch.device("cpu")) == 8748
    for n in (1, VALUE_CHUNK, VALUE_CHUNK + 1, 8748):
        got = static_cache_len(n, torch.device("cuda"))
        assert got % VALUE_CHUNK == 0 and n <= got < n + VALUE_CHUNK


def test_a_failing_flash_linear_attention_prefill_falls_back_to_qfds_form(monkeypatch):
    """If the package's kernels fail on a GPU (a Triton version they do not compile with), the
    prompt still runs through qfd's own chunked form, with one warning."""
    from qfd import kernels
    from qfd.kernels import gdn_fla
    from qfd.models.gdn import chunked_gated_delta, chunked_gated_delta_qfd

    monkeypatch.setattr(kernels, "_FAILED", set())
    monkeypatch.setattr(gdn_fla, "takes", lambda q: True)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("triton: out of resources")

    monkeypatch.setattr(gdn_fla, "chunked_gated_delta", broken)
    q, k, v, g, beta, state = step_inputs(B=1, T=40, dk=32, dv=48)
    with pytest.warns(RuntimeWarning, match="flash-linear-attention"):
        out, final = chunked_gated_delta(q, k, v, g, beta, state, chunk_size=16)
    expected, expected_final = chunked_gated_delta_qfd(q, k, v, g, beta, state, chunk_size=16)
    assert torch.equal(out, expected) and torch.equal(final, expected_final)
    chunked_gated_delta(q, k, v, g, beta, state, chunk_size=16)
    assert calls == [1]  # not retried


def rolled_back_caches(device, dtype, T=16, layers=3, C=40, K=4, H=4, dk=16, dv=24, seed=0):
    """Two identical TargetCaches of `layers` GDN states, as after a T-token forward: random
    live / start / history / conv state and a random conv window per layer."""
    from qfd.models.cache import GDNState, TargetCache

    torch.manual_seed(seed)
    caches = []
    for _ in range(2):
        caches.append(TargetCache({}, {}, {i: GDNState(1, C, K, H, dk, dv, 16, dtype, device) for i in range(layers)}, max_len=64, static=True))
    for i in range(layers):
        values = [torch.randn(1, C, K - 1 + T).to(dtype), torch.randn(1, H, dk, dv), torch.randn(1, H, dk, dv), torch.randn(1, 16, H, dk, dv), torch.randn(1, C, K - 1).to(dtype)]
        for cache in caches:
            state = cache.gdn[i]
            window, recurrent, start, history, conv = (v.to(device) for v in values)
            state.recurrent.copy_(recurrent), state.start.copy_(start), state.history.copy_(history), state.conv.copy_(conv)
            state.window, state.steps = window, T
    for cache in caches:  # the T-token forward these states came from
        cache.begin(T)
        cache.end(T)
    return caches


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("keep", [0, 1, 7, 15])
def test_one_launch_rollback_equals_the_per_layer_copies(dtype, keep, monkeypatch):
    """`TargetCache.rollback` restores every layer's recurrent and conv state in one Triton
    launch (gdn_rollback_triton) bit for bit as the per-layer copies (ONE_LAUNCH_ROLLBACK off)."""
    from qfd.kernels import gdn_rollback_triton
    from qfd.models import cache as cache_module

    launches = []
    real_restore = gdn_rollback_triton.restore
    monkeypatch.setattr(gdn_rollback_triton, "restore", lambda *args, **kw: launches.append(1) or real_restore(*args, **kw))
    monkeypatch.setattr(cache_module, "ONE_LAUNCH_ROLLBACK", True)  # whatever QFD_GDN_ROLLBACK says
    one_launch, per_layer = rolled_back_caches(KERNEL_DEVICE, dtype)
    one_launch.rollback(keep)
    monkeypatch.setattr(cache_module, "ONE_LAUNCH_ROLLBACK", False)
    per_layer.rollback(keep)
    assert launches == [1]
    for i, state in one_launch.gdn.items():
        assert torch.equal(state.recurrent, per_layer.gdn[i].recurrent)
        assert torch.equal(state.conv, per_layer.gdn[i].conv)
        assert not torch.equal(state.recurrent, per_layer.gdn[i].history[:, keep])  # the slot, not its neighbour


@needs_triton
@pytest.mark.parametrize("node", [0, 5, 15])
def test_one_launch_tree_keep_equals_the_per_layer_copies(node, monkeypatch):
    """`keep_tree_path`: the kept node's state and its path's conv columns, in one launch."""
    from qfd.models import cache as cache_module

    one_launch, per_layer = rolled_back_caches(KERNEL_DEVICE, torch.bfloat16)
    conv_index = torch.randint(0, 3 + 16, (16, 4), generator=torch.Generator().manual_seed(node)).to(KERNEL_DEVICE)
    for cache in (one_launch, per_layer):
        cache.kv = torch.zeros(1)  # a tree path is kept only in a model's cache; no attention layers here
        for state in cache.gdn.values():
            state.tree_conv = conv_index
    one_launch.keep_tree_path([node])  # the path's last node is the one kept
    monkeypatch.setattr(cache_module, "ONE_LAUNCH_ROLLBACK", False)
    per_layer.keep_tree_path([node])
    for i, state in one_launch.gdn.items():
        assert torch.equal(state.recurrent, per_layer.gdn[i].recurrent)
        assert torch.equal(state.conv, per_layer.gdn[i].conv)
        assert state.window is None and state.steps == 0


def test_token_records_replay_to_the_history_exactly():
    """The torch reference's per-token records (k, delta, decay) rebuild every position's
    state bit for bit: what a rollback from records returns equals the history's slot."""
    from qfd.models.gdn import replay_update

    q, k, v, g, beta, state = step_inputs(T=6)
    history = torch.zeros(1, 6, *state.shape[1:])
    records = torch.zeros(1, 6, state.shape[1], k.shape[-1] + v.shape[-1] + 1)
    out_states, final_states = recurrent_gated_delta(q, k, v, g, beta, state, history=history)
    out_records, final_records = recurrent_gated_delta(q, k, v, g, beta, state, records=records)
    assert torch.equal(out_states, out_records) and torch.equal(final_states, final_records)
    replayed = state
    for t in range(6):
        replayed = replay_update(replayed, records[:, t])
        assert torch.equal(replayed, history[:, t])


def conv_step_states(monkeypatch, dtype, T):
    """Two GDN caches of one layer advanced by the same conv-step forward of T tokens: one
    recording the history (states), one the token records (QFD_GDN_HISTORY=records)."""
    from qfd.models import cache as cache_module

    (window, conv_weight, a, b, A_log, dt_bias, state0), (k_heads, dk, H, dv) = conv_step_inputs(dtype, KERNEL_DEVICE, B=1, T=T, channels_last=True)
    caches, outs = [], []
    for records in (False, True):
        monkeypatch.setattr(cache_module, "RECORD_UPDATES", records)
        gdn = cache_module.GDNState(1, window.shape[1], conv_weight.shape[-1], H, dk, dv, 16, dtype, KERNEL_DEVICE)
        gdn.recurrent.copy_(state0)
        cache = cache_module.TargetCache({}, {}, {0: gdn}, max_len=64, static=True)
        cache.begin(T)
        outs.append(gdn.advance_window(window, conv_weight, a, b, A_log, dt_bias, k_heads))
        cache.end(T)
        assert gdn.from_records is records
        caches.append(cache)
    return caches, outs


@needs_triton
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_kernel_token_records_roll_back_bit_for_bit(prefetch, dtype, monkeypatch):
    """The conv-step kernel writing token records instead of states gives the same outputs,
    state and conv state; replaying all its records rebuilds its own final state bit for bit
    (a rollback's exactness), and a rollback from them (one launch for all layers, or the
    layer's own) restores the state the history held for that position. All bit for bit under
    the interpreter. On the H100 the replay is bit-exact at Qwen3.5-4B's layer shape (dk = dv =
    128, bench_gdn_step.py) and at this small shape in float32, but here in bf16 ~5% of the
    elements differ by one float32 ulp (docs/benchmarks.md, 2026-12-07 twentieth session; see
    gdn_rollback_triton's docstring), so the GPU check is within 1e-6."""
    from qfd.models import cache as cache_module

    monkeypatch.setattr(gdn_triton, "PREFETCH", prefetch)
    T = 7
    (states, records), (out_states, out_records) = conv_step_states(monkeypatch, dtype, T)
    history_state, record_state = states.gdn[0], records.gdn[0]

    def same(got, expected, atol=1e-5):
        if KERNEL_DEVICE == "cpu":
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=0, atol=atol)

    same(record_state._replayed(T), record_state.recurrent, atol=1e-6)

    same(out_records, out_states)
    same(record_state.recurrent, history_state.recurrent)
    assert torch.equal(history_state.conv, record_state.conv) and torch.equal(history_state.start, record_state.start)
    expected = {keep: history_state.history[:, keep - 1].clone() for keep in range(1, T)}
    for keep in (5, 2, 0):  # each within the same forward
        for one_launch in (True, False):
            monkeypatch.setattr(cache_module, "ONE_LAUNCH_ROLLBACK", one_launch)
            replayed = record_state._replayed(keep) if keep else record_state.start.clone()
            records.rollback(keep)
            states.rollback(keep)
            assert torch.equal(record_state.recurrent, replayed), (keep, one_launch)  # one launch = the layer's own replay
            same(record_state.recurrent, history_state.recurrent)
            assert torch.equal(record_state.conv, history_state.conv)
            if keep:
                same(record_state.recurrent, expected[keep])
