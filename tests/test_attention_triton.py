"""The split-KV step attention (`qfd.kernels.attention_triton`; the default on CUDA, QFD_ATTENTION_KERNEL=torch for the torch path).

On CI (no Triton) these check the float32 reference the kernel is held to against the served
torch path (`grouped_attention`) and the launch arithmetic. The kernels themselves run on a
GPU or under TRITON_INTERPRET=1 with Triton installed: against the reference for decode,
verify and tree masks, and inside the model (a tree verify equals a plain forward over each
path; the served engine's output equals greedy decoding)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from qfd.kernels import attention_triton
from qfd.kernels.attention_triton import block_rows_for, launch_shape, parse_configs
from qfd.models.target import grouped_attention
from tests.test_gdn_kernel import KERNEL_DEVICE, needs_triton
from tests.test_tree import targets  # noqa: F401 (fixture)


def reference_attention(q, k, v, mask):
    """What the kernels compute, in float32 torch: q [B, H, T, D] over k/v [B, KVH, S, D], mask
    [T, S] bool (True = visible); query head h reads kv head h // (H / KVH)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ v).to(q.dtype)


def attention_inputs(B, H, KVH, T, S, D, kind, seed=0, dtype=torch.float32, device="cpu"):
    """q/k/v and a [T, S] mask: "decode"/"verify" - each query sees the keys up to its position
    (the last T of `S - 7` filled slots; the static cache's tail stays masked); "tree" - the
    context plus a random ancestor set (itself included) among the T step slots."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, KVH, S, D, generator=g), torch.randn(B, KVH, S, D, generator=g)
    filled = S - 7
    positions = torch.arange(filled - T, filled)
    mask = torch.arange(S)[None, :] <= positions[:, None]
    if kind == "tree":
        ancestors = torch.rand(T, T, generator=g) < 0.4
        ancestors = ancestors.tril() | torch.eye(T, dtype=torch.bool)
        mask[:, filled - T : filled] = ancestors
    return [x.to(dtype).to(device) for x in (q, k, v)] + [mask.to(device)]


def test_the_reference_is_the_served_torch_attention():
    q, k, v, mask = attention_inputs(2, 8, 2, 5, 300, 32, "tree")
    torch.testing.assert_close(reference_attention(q, k, v, mask), grouped_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,keys,processors", [(4, 8704, 132), (64, 8704, 132), (128, 8704, 132), (4, 200, 132), (16, 64, 4), (2, 1, 8), (4, 8704, 1000)])
@pytest.mark.parametrize("block_keys", [32, 64])
def test_the_splits_cover_every_key_once(rows, keys, processors, block_keys):
    splits, per_split = launch_shape(1, 4, rows, keys, processors, block_keys)
    assert per_split % block_keys == 0 and (splits - 1) * per_split < keys <= splits * per_split
    assert splits <= 64  # the merge's one load
    row_blocks = -(-rows // block_rows_for(rows))
    assert 4 * row_blocks * splits <= max(2 * processors, 4 * row_blocks)  # about two programs per multiprocessor


def test_after_a_failure_the_steps_use_the_torch_path(monkeypatch):
    """A GPU where the kernels do not compile: the op falls back once (warned, slow float32
    reference); every later step takes the torch path instead of the op."""
    from qfd import kernels

    q = torch.zeros(1, 4, 1, 64)
    monkeypatch.setattr(attention_triton, "SPLIT_KERNEL", True)
    monkeypatch.setattr(attention_triton, "runs_on", lambda x: True)
    monkeypatch.setattr(kernels, "_FAILED", set())
    assert attention_triton.takes(q)
    kernels._FAILED.add("split_attention")
    assert not attention_triton.takes(q)


def test_where_the_kernels_fail_the_op_gives_the_torch_paths_result(monkeypatch):
    from qfd import kernels

    monkeypatch.setattr(kernels, "_FAILED", set())
    monkeypatch.setattr(attention_triton, "_split_kernel", None, raising=False)  # "fails to compile"
    q, k, v, mask = attention_inputs(1, 8, 2, 3, 100, 32, "tree")
    with pytest.warns(RuntimeWarning, match="split_attention"):
        out = attention_triton.split_attention(q, k, v, mask)
    assert "split_attention" in kernels._FAILED
    torch.testing.assert_close(out, grouped_attention(q, k, v, mask))


def test_launch_configs_from_the_environment():
    from qfd.errors import QfdError

    assert parse_configs("16=32,4,2; 64=64,8,1") == {16: (32, 4, 2), 64: (64, 8, 1)}
    assert parse_configs("") == {}
    with pytest.raises(QfdError, match="QFD_ATTENTION_CONFIG"):
        parse_configs("16=32,4")


@needs_triton
@pytest.mark.parametrize(
    "B,H,KVH,T,S,D,kind",
    [
        (1, 8, 2, 1, 300, 64, "decode"),  # several splits, a partial last key block
        (2, 4, 4, 16, 260, 32, "verify"),  # no grouping, batch 2
        (1, 16, 4, 32, 200, 256, "tree"),  # Qwen3.5-4B's heads: 128 rows per kv head = 2 row blocks
        (1, 4, 2, 9, 90, 16, "tree"),
    ],
)
def test_kernel_matches_the_reference(B, H, KVH, T, S, D, kind, monkeypatch):
    from qfd import kernels

    monkeypatch.setattr(kernels, "_FAILED", set())
    q, k, v, mask = attention_inputs(B, H, KVH, T, S, D, kind, device=KERNEL_DEVICE)
    out = attention_triton.split_attention(q, k, v, mask)
    assert not kernels._FAILED  # the kernels ran (no torch fallback)
    torch.testing.assert_close(out, reference_attention(q, k, v, mask), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("T,kind", [(1, "decode"), (5, "tree")])
def test_the_merge_applies_an_output_gate_as_the_torch_form(T, kind, monkeypatch):
    """Qwen3.5's output gate in the merge kernel: out * sigmoid(gate), gate a strided view (the
    query projection's interleaved [query | gate] halves)."""
    from qfd import kernels

    monkeypatch.setattr(kernels, "_FAILED", set())
    q, k, v, mask = attention_inputs(1, 8, 2, T, 300, 64, kind, device=KERNEL_DEVICE)
    gate = torch.randn(1, T, 8, 128, device=KERNEL_DEVICE)[..., 64:] * 3
    out = attention_triton.split_attention(q, k, v, mask, gate=gate)
    assert not kernels._FAILED
    want = reference_attention(q, k, v, mask) * torch.sigmoid(gate).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize(
    "T,S,filled,kind",
    [
        (1, 300, 5, "decode"),  # the live keys in one block of one split
        (1, 300, 200, "decode"),
        (16, 260, 40, "verify"),
        (9, 290, 120, "tree"),
        (1, 300, 300, "decode"),  # a full cache: the count changes nothing
    ],
)
def test_the_kernels_read_only_the_keys_before_the_count(T, S, filled, kind, monkeypatch):
    """key_count = the step's last slot + 1: the cache's tail from there on is not read. NaN
    there would reach the output through the values' product were it read (0 * NaN = NaN)."""
    from qfd import kernels

    monkeypatch.setattr(kernels, "_FAILED", set())
    q, k, v, _ = attention_inputs(1, 8, 2, T, S, 64, "decode", device=KERNEL_DEVICE)
    positions = torch.arange(filled - T, filled, device=q.device)
    mask = torch.arange(S, device=q.device)[None, :] <= positions[:, None]
    if kind == "tree":
        mask[:, filled - T : filled] = torch.ones(T, T, dtype=torch.bool).tril()
    expected = reference_attention(q, k, v, mask)
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    out = attention_triton.split_attention(q, k, v, mask, positions[-1:] + 1)
    assert not kernels._FAILED
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    if filled < S:  # without the count the kernels read the whole buffer: the NaN shows
        assert attention_triton.split_attention(q, k, v, mask).isnan().any()


@needs_triton
@pytest.mark.parametrize("T,kind", [(1, "decode"), (16, "verify"), (32, "tree")])
def test_kernel_in_bf16_on_a_gpu(T, kind, monkeypatch):
    """Qwen3.5-4B's attention heads over an 8.5K static cache, as the steps run them."""
    from qfd import kernels

    if not torch.cuda.is_available():
        pytest.skip("bf16 tl.dot: the interpreter cannot")
    monkeypatch.setattr(kernels, "_FAILED", set())
    q, k, v, mask = attention_inputs(1, 16, 4, T, 8704, 256, kind, dtype=torch.bfloat16, device="cuda")
    expected = reference_attention(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(attention_triton.split_attention(q, k, v, mask).float(), expected, rtol=2e-2, atol=2e-2)
    assert not kernels._FAILED


# The tiny targets of tests/test_tree.py live on the CPU: their steps reach the kernels only
# under Triton's interpreter (on a GPU machine without it they would test the torch path).
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU models reach the kernels only under TRITON_INTERPRET=1 (the GPU test below runs them on CUDA)",
)


@needs_interpreter
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("fixed_shape", [False, True])
def test_a_tree_verify_through_the_kernel_equals_a_forward_over_each_path(targets, family, fixed_shape, monkeypatch):
    from tests.test_tree import test_tree_verify_equals_a_forward_over_each_path

    calls = []
    real = attention_triton.split_attention
    monkeypatch.setattr(attention_triton, "SPLIT_KERNEL", True)
    monkeypatch.setattr(attention_triton, "split_attention", lambda *a: calls.append(1) or real(*a))
    test_tree_verify_equals_a_forward_over_each_path(targets, family, fixed_shape)
    assert calls  # the steps' attention went through the kernel


@needs_interpreter
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_engine_through_the_kernel_equals_target_greedy(targets, tiny_checkpoints, family, monkeypatch):
    """Target-only and speculative (chain and tree) decoding with the kernel give the tokens of
    target-only decoding through the torch attention (float32: no near-ties)."""
    from qfd.engine import Engine
    from tests.test_engine import greedy, make_drafter, prompt_ids

    target = targets[family]
    monkeypatch.setattr(attention_triton, "SPLIT_KERNEL", False)
    expected = Engine(target, max_len=128).generate(prompt_ids(), greedy()).tokens
    monkeypatch.setattr(attention_triton, "SPLIT_KERNEL", True)
    drafter = make_drafter(tiny_checkpoints[family])
    assert Engine(target, max_len=128).generate(prompt_ids(), greedy()).tokens == expected
    assert Engine(target, drafter=drafter, max_len=128).generate(prompt_ids(), greedy()).tokens == expected
    assert Engine(target, drafter=drafter, max_len=128, tree_size=8).generate(prompt_ids(), greedy()).tokens == expected


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or not torch.cuda.is_available(), reason="needs Triton and a GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_on_a_gpu_the_engine_through_the_kernel_equals_the_torch_path(tiny_checkpoints, family, monkeypatch):
    """The tiny targets on CUDA (float32, CUDA graphs as served): target-only, chain and tree
    decoding with the steps' attention in the kernels give the torch path's target-only tokens,
    and the kernels ran (no fallback)."""
    from qfd import kernels
    from qfd.engine import Engine
    from qfd.models.loading import load_target
    from tests.test_engine import greedy, make_drafter, prompt_ids

    monkeypatch.setattr(kernels, "_FAILED", set())
    target = load_target(tiny_checkpoints[family], device="cuda", tokenizer=False)[0]
    drafter = make_drafter(tiny_checkpoints[family]).to("cuda")
    monkeypatch.setattr(attention_triton, "SPLIT_KERNEL", False)
    expected = Engine(target, max_len=128).generate(prompt_ids(), greedy()).tokens
    calls = []
    real = attention_triton.split_attention
    monkeypatch.setattr(attention_triton, "SPLIT_KERNEL", True)
    monkeypatch.setattr(attention_triton, "split_attention", lambda *a: calls.append(1) or real(*a))
    assert Engine(target, max_len=128).generate(prompt_ids(), greedy()).tokens == expected
    assert Engine(target, drafter=drafter, max_len=128).generate(prompt_ids(), greedy()).tokens == expected
    assert Engine(target, drafter=drafter, max_len=128, tree_size=8).generate(prompt_ids(), greedy()).tokens == expected
    assert calls and not kernels._FAILED


@needs_triton
@pytest.mark.parametrize("window", [None, 24])
def test_a_drafters_draft_through_the_kernel_equals_its_torch_attention(window, monkeypatch):
    """The drafter's attention (the block's queries over its context window + the block, no
    causality inside the block) through the kernels gives SDPA's draft logits (float32), with
    and without a sliding window, eagerly and in the served fixed-shape step, and the kernels ran."""
    from qfd import kernels
    from qfd.models.drafter import DFlashDrafter, config_for_target
    from qfd.models.graphs import StaticDraftStep

    monkeypatch.setattr(kernels, "_FAILED", set())
    shape = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    cfg = config_for_target(shape, num_layers=2, block_size=8, sliding_window=window, mask_token_id=95)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(KERNEL_DEVICE).eval()
    embed = torch.nn.Embedding(96, 64).to(KERNEL_DEVICE)
    head = torch.nn.Linear(64, 96, bias=False).to(KERNEL_DEVICE)
    cache = drafter.new_cache(80, device=KERNEL_DEVICE)
    taps = torch.randn(1, 40, len(cfg.target_layer_ids) * 64, device=KERNEL_DEVICE)
    with torch.no_grad():
        drafter.append_context(cache, taps, 0)

    def draft_logits():
        with torch.no_grad():
            return drafter.draft(cache, torch.tensor([[5]], device=KERNEL_DEVICE), 40, embed, head, return_logits=True)[1]

    calls = []
    real = attention_triton.split_attention
    monkeypatch.setattr(attention_triton, "split_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(attention_triton, "SPLIT_KERNEL", False)
    expected = draft_logits()
    assert not calls
    monkeypatch.setattr(attention_triton, "SPLIT_KERNEL", True)
    torch.testing.assert_close(draft_logits(), expected, rtol=1e-4, atol=1e-4)
    # the served fixed-shape step (its window gathered from the cache, padding masked)
    step = StaticDraftStep(drafter, cache, embed=embed, head=head)
    assert step(5, 40).reshape(-1).tolist() == expected.argmax(-1).reshape(-1).tolist()
    assert calls and not kernels._FAILED
