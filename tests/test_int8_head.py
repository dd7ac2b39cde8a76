"""--int8-head: the LM head as INT8 with group scales (qfd.quant.head.Int8Head), its Triton kernel
(qfd.kernels.int8_triton: under TRITON_INTERPRET=1 on a CPU, or on CUDA), and its wiring."""

from __future__ import annotations

import pytest
import torch

from qfd.errors import QfdError
from qfd.kernels import HAVE_TRITON, interpreting
from qfd.kernels.int8_triton import Int8Config, dequantize_int8, quantize_int8, reference_matmul
from qfd.models.loading import load_target
from qfd.quant.head import Int8Head, quantize_head

needs_kernel = pytest.mark.skipif(not (HAVE_TRITON and (torch.cuda.is_available() or interpreting())),
                                  reason="needs Triton on CUDA or its interpreter (TRITON_INTERPRET=1)")


def _weight(n=96, k=256, seed=0, dtype=torch.float32):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_quantize_int8_rounds_to_nearest_per_row_and_group():
    w = _weight()
    w[3, :64] = 0  # a zero group: scale 1, codes 0
    q, s = quantize_int8(w, 64)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (4, 96)
    assert int(q.abs().max()) == 127 and int(q[3, :64].abs().max()) == 0 and float(s[0, 3]) == 1.0
    w_hat = dequantize_int8(q, s)
    step = s.t().repeat_interleave(64, dim=1)  # [N, K]: each weight's scale
    assert bool(((w_hat - w).abs() <= step / 2 + 1e-6).all())  # nearest point of the grid
    # each (row, group)'s largest |w| lands on +-127 exactly
    torch.testing.assert_close(w.reshape(96, 4, 64).abs().amax(-1), w_hat.reshape(96, 4, 64).abs().amax(-1))



def test_the_reference_product_dequantizes_a_chunk_of_outputs_at_a_time(monkeypatch):
    """Chunks of 40 outputs (a partial last one of 16): the same product as the whole weight."""
    import qfd.kernels.int8_triton as int8_triton

    q, s = quantize_int8(_weight(), 64)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    whole = x @ dequantize_int8(q, s).t()
    monkeypatch.setattr(int8_triton, "REFERENCE_CHUNK", 40)
    torch.testing.assert_close(reference_matmul(x, q, s), whole, atol=1e-5, rtol=1e-5)

def test_quantize_int8_rounds_the_scale_to_its_dtype_before_the_codes():
    w = _weight(dtype=torch.bfloat16)
    q, s = quantize_int8(w, 128, scale_dtype=torch.bfloat16)
    assert s.dtype == torch.bfloat16
    # the codes are nearest for the bf16 scale the kernel reads
    exact = (w.float().reshape(96, 2, 128) / s.float().t().unsqueeze(-1)).reshape(96, 256)
    assert bool(((q.float() - exact).abs() <= 0.5 + 1e-3).all())


def test_quantize_int8_refuses_a_width_the_group_does_not_divide():
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_int8(_weight(k=96), 64)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32])
@pytest.mark.parametrize("group", [64, 128])
def test_kernel_matches_the_reference(rows, group):
    from qfd.kernels.int8_triton import int8_matmul

    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    w = _weight(n=200, k=256)  # N not a multiple of the block: the masked edge
    q, s = quantize_int8(w, group)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    q, s, x = q.to(device), s.to(device), x.to(device)
    torch.testing.assert_close(int8_matmul(x, q, s), reference_matmul(x, q, s), atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="CUDA: the Triton 3.6 interpreter's bf16 tl.dot returns garbage (a plain 16x16 bf16 dot does)")
def test_kernel_in_bf16_is_within_bf16_rounding_and_takes_a_strided_leading_shape():
    from qfd.kernels.int8_triton import int8_matmul

    device = "cuda"
    q, s = quantize_int8(_weight(n=130, k=128), 128, scale_dtype=torch.bfloat16)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(7))[..., :128].to(torch.bfloat16)  # rows strided
    q, s, x = q.to(device), s.to(device), x.to(device)
    y = int8_matmul(x, q, s)
    assert y.shape == (2, 5, 130) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference_matmul(x.float(), q, s.float()), atol=3e-2, rtol=2e-2)
    one = int8_matmul(x[0, :1], q, s)  # one row: the CUDA-core path
    torch.testing.assert_close(one.float(), y[0, :1].float(), atol=3e-2, rtol=2e-2)


@needs_kernel
def test_one_row_path_in_bf16_is_within_bf16_rounding():
    from qfd.kernels.int8_triton import int8_matmul

    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    q, s = quantize_int8(_weight(n=130, k=128), 128, scale_dtype=torch.bfloat16)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    q, s, x = q.to(device), s.to(device), x.to(device)
    torch.testing.assert_close(int8_matmul(x, q, s).float(), reference_matmul(x.float(), q, s.float()), atol=3e-2, rtol=2e-2)


@needs_kernel
def test_one_row_path_refuses_more_rows():
    from qfd.kernels.int8_triton import int8_matmul

    q, s = quantize_int8(_weight(), 64)
    with pytest.raises(ValueError, match="one row"):
        int8_matmul(torch.randn(2, 256), q, s, Int8Config(use_dot=False, block_n=64))


@pytest.mark.parametrize("kernel", [None, "triton"])
def test_int8_head_swaps_in_and_computes_the_int8_weight(tiny_checkpoints, kernel):
    if kernel == "triton" and not (HAVE_TRITON and interpreting()):
        pytest.skip("the kernel path on a CPU needs TRITON_INTERPRET=1")
    model, _ = load_target(tiny_checkpoints["llama"])
    weight = model.lm_head.weight.detach().clone()
    head = quantize_head(model, group_size=64, bits=8, kernel=kernel)
    assert model.lm_head is head and isinstance(head, Int8Head) and head.group_size == 64
    assert (head.weight_dense is None) == (kernel == "triton")
    x = torch.randn(3, 5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    q, s = quantize_int8(weight, 64)
    torch.testing.assert_close(head(x), x @ dequantize_int8(q, s).T, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(head(x), x @ weight.T, atol=1e-6)  # it did move to the INT8 grid
    torch.testing.assert_close(head.dequantized_weight(torch.float32), dequantize_int8(q, s))
    with pytest.raises(QfdError, match="already quantized"):
        quantize_head(model, bits=8)


def test_int8_head_moves_logits_less_than_int4(tiny_checkpoints):
    base, _ = load_target(tiny_checkpoints["qwen3_5"])
    x = torch.randn(8, base.config.hidden_size, generator=torch.Generator().manual_seed(3))
    dense = base.lm_head(x)
    errors = {}
    for bits in (4, 8):
        model, _ = load_target(tiny_checkpoints["qwen3_5"])
        quantize_head(model, group_size=64, bits=bits)
        errors[bits] = float((model.lm_head(x) - dense).abs().mean())
    assert 0 < errors[8] < errors[4] / 8, errors


def test_load_target_int8_head_and_the_engine_decodes_with_it(tiny_checkpoints):
    """Greedy through the engine = the argmax of the INT8-head model's own logits."""
    from qfd.engine import Engine, GenerationConfig

    model, _ = load_target(tiny_checkpoints["qwen3_5"], int8_head=True)
    assert isinstance(model.lm_head, Int8Head) and model.lm_head.group_size == 64
    prompt = [5, 9, 2, 7]
    tokens = Engine(model, max_len=32, eos_ids=()).generate(prompt, GenerationConfig(max_new_tokens=6)).tokens
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    assert tokens == logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_load_target_refuses_both_head_formats(tiny_checkpoints):
    with pytest.raises(QfdError, match="--int4-head or --int8-head"):
        load_target(tiny_checkpoints["llama"], int4_head=True, int8_head=True)


def test_draft_vocab_head_builds_from_an_int8_head(tiny_checkpoints):
    from qfd.draft_vocab import DraftVocabHead

    model, _ = load_target(tiny_checkpoints["qwen3_5"], int8_head=True)
    ids = torch.tensor([5, 0, 17])
    sub = DraftVocabHead.of_target(model, ids)
    x = torch.randn(2, model.config.hidden_size)
    torch.testing.assert_close(sub(x), model.lm_head(x)[:, ids], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_on_a_gpu_the_engine_with_an_int8_head_is_lossless(tiny_checkpoints, family, monkeypatch):
    """The tiny targets on CUDA (float32, CUDA graphs as served) with their head in INT8 through the
    kernel: chain and tree speculative decoding give target-only decoding's tokens, which are the
    INT8-head model's own argmax; the kernel ran (no fallback)."""
    from qfd import kernels
    from qfd.engine import Engine
    from tests.test_engine import greedy, make_drafter, prompt_ids

    monkeypatch.setattr(kernels, "_FAILED", set())
    target = load_target(tiny_checkpoints[family], device="cuda", tokenizer=False, int8_head=True)[0]
    assert isinstance(target.lm_head, Int8Head) and target.lm_head.weight_dense is None
    drafter = make_drafter(tiny_checkpoints[family]).to("cuda")
    prompt = prompt_ids()
    expected = Engine(target, max_len=128).generate(prompt, greedy()).tokens
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + expected], device="cuda")).logits[0]
    assert expected == logits[len(prompt) - 1 : len(prompt) - 1 + len(expected)].argmax(-1).tolist()
    assert Engine(target, drafter=drafter, max_len=128).generate(prompt, greedy()).tokens == expected
    assert Engine(target, drafter=drafter, max_len=128, tree_size=8).generate(prompt, greedy()).tokens == expected
    assert not kernels._FAILED
