"""--int4-head: the target's LM head swapped for an RTN INT4 Int4Linear at load (qfd.quant.head),
wired through load_target, the draft-vocabulary head, and the generate / serve / eval CLIs."""

from __future__ import annotations

import pytest
import torch

from qfd.errors import QfdError
from qfd.models.loading import load_target
from qfd.quant.grid import dequantize, rtn_quantize
from qfd.quant.head import head_group_size, quantize_head
from tests.test_draft_vocab import _cli
from qfd.quant.int4_linear import Int4Linear


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory):
    """Tiny checkpoints of hidden size 128, so --int4-head's group 128 divides the head's
    width (conftest's tiny ones are 64 wide): a hybrid untied one and a tied dense one."""
    from tests.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("int4head")
    return {
        "untied": make_tiny_checkpoint("qwen3_5", root / "untied", hidden_size=128),
        "tied": make_tiny_checkpoint("llama", root / "tied", hidden_size=128, tie_word_embeddings=True),
    }


def _rtn_reference(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    return dequantize(rtn_quantize(weight.detach().float(), group_size, scale_dtype=weight.dtype), weight.dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_quantize_head_swaps_an_int4_linear_computing_the_rtn_weight(tiny_checkpoints, family):
    model, _ = load_target(tiny_checkpoints[family])
    weight = model.lm_head.weight.detach().clone()
    head = quantize_head(model, group_size=64)  # the tiny checkpoints are 64 wide
    assert model.lm_head is head and isinstance(head, Int4Linear) and head.group_size == 64
    x = torch.randn(3, 5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    expected = x @ _rtn_reference(weight, 64).T
    torch.testing.assert_close(head(x), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(head(x), x @ weight.T, atol=1e-3)  # it did move to the INT4 grid


def test_tied_head_gets_its_own_int4_copy_and_the_embedding_stays_dense(wide_checkpoints):
    model, _ = load_target(wide_checkpoints["tied"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    table = model.model.embed_tokens.weight.detach().clone()
    quantize_head(model)
    embed = model.model.embed_tokens.weight
    assert isinstance(model.lm_head, Int4Linear) and model.lm_head.group_size == 128
    assert isinstance(embed, torch.nn.Parameter) and embed.dtype == table.dtype and torch.equal(embed, table)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.testing.assert_close(model.embed(ids), table[ids], atol=0, rtol=0)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.lm_head(x), x @ _rtn_reference(table, 128).T, atol=1e-5, rtol=1e-5)


def test_quantize_head_refuses_a_quantized_head_and_a_width_the_group_does_not_divide(tiny_checkpoints):
    model, _ = load_target(tiny_checkpoints["llama"])
    quantize_head(model, group_size=64)
    with pytest.raises(QfdError, match="already quantized"):
        quantize_head(model, group_size=64)
    with pytest.raises(QfdError, match="input width 64 is not a multiple of the group size 128"):
        quantize_head(load_target(tiny_checkpoints["llama"])[0], group_size=128)
    # --int4-head itself falls back to the largest of 128 / 64 / 32 that divides the width
    assert load_target(tiny_checkpoints["llama"], int4_head=True)[0].lm_head.group_size == 64
    assert [head_group_size(w) for w in (2560, 576, 96, 40)] == [128, 64, 32, None]


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_load_target_int4_head_logits_are_close_but_not_equal(wide_checkpoints, kind):
    dense, _ = load_target(wide_checkpoints[kind])
    int4, _ = load_target(wide_checkpoints[kind], int4_head=True)
    assert isinstance(int4.lm_head, Int4Linear) and not isinstance(dense.lm_head, Int4Linear)
    ids = torch.randint(0, dense.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a, b = dense(ids).logits, int4(ids).logits
    assert (a - b).abs().max() > 1e-3  # a different target...
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cosine.min() > 0.98, cosine.min()  # ...but a close one (0.991 here)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    assert agree >= 0.7, agree  # 0.83 / 0.89 here: random tiny logits are flat, near-ties flip


def test_engine_decodes_with_an_int4_head(wide_checkpoints):
    """Greedy through the engine = the argmax of the INT4-head model's own logits."""
    from qfd.engine import Engine, GenerationConfig

    model, _ = load_target(wide_checkpoints["untied"], int4_head=True)
    prompt = [5, 9, 2, 7]
    tokens = Engine(model, max_len=32, eos_ids=()).generate(prompt, GenerationConfig(max_new_tokens=6)).tokens
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    assert tokens == logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_draft_vocab_head_builds_from_an_int4_head(wide_checkpoints):
    from qfd.draft_vocab import DraftVocabHead

    model, _ = load_target(wide_checkpoints["untied"], int4_head=True)
    ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(3))[:40]
    head = DraftVocabHead.of_target(model, ids)
    assert head.weight.shape == (40, 128) and head.weight.dtype == model.lm_head.dtype
    hidden = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(head(hidden), model.lm_head(hidden)[..., ids], atol=1e-5, rtol=1e-5)
    with pytest.raises(QfdError, match="lm_head has none"):
        DraftVocabHead.of_target(torch.nn.Module(), ids)  # no head at all: still refused


# --- the command line ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "serve", "eval"])
def test_help_lists_int4_head(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps help to the terminal width
    code, out, _ = _cli([command, "--help"], capsys)
    assert code == 0 and "--int4-head" in out and "--int8-head" in out


@pytest.fixture
def load_spy(monkeypatch):
    """load_target replaced by a stub that ends the command with the head flags it was given."""

    def stub(*args, int4_head=False, int8_head=False, **kwargs):
        raise QfdError(f"load_target called with int4_head={int4_head} int8_head={int8_head}")

    monkeypatch.setattr("qfd.models.loading.load_target", stub)


@pytest.mark.parametrize("flag", [[], ["--int4-head"], ["--int8-head"]])
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"], ["eval", "latency", "--scale", "0.01"]])
def test_commands_pass_int4_head_to_load_target(tiny_checkpoints, load_spy, tmp_path, capsys, command, flag):
    out = []
    if command[0] == "eval":  # its own prompts: the test runs without ../shared/data too
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"question": "What is 2 + 2?"}\n')
        out = ["--out", tmp_path / "eval", "--prompts", prompts]
    code, _, err = _cli([*command, "--target", tiny_checkpoints["llama"], "--device", "cpu", *out, *flag], capsys)
    assert code != 0 and f"load_target called with int4_head={flag == ['--int4-head']} int8_head={flag == ['--int8-head']}" in err, err


def test_eval_int4_head_is_the_targets_not_the_baselines():
    from pathlib import Path

    from qfd.stages.eval import EvalConfig, systems

    plan = {"target": Path("q4"), "drafter": Path("dflash"), "baseline": Path("bf16")}
    with_baseline = systems(EvalConfig(tasks=("latency",), target="q4", out=Path("o"), drafter="dflash", baseline="bf16", int4_head=True), plan)
    assert [(s.role, s.int4_head) for s in with_baseline] == [("system", True), ("baseline", False)]
    implicit = systems(EvalConfig(tasks=("latency",), target="q4", out=Path("o"), drafter="dflash", int4_head=True), plan)
    assert [(s.role, s.int4_head) for s in implicit] == [("system", True), ("baseline", True)]  # the same target, target-only
    assert [s.int4_head for s in systems(EvalConfig(tasks=("latency",), target="q4", out=Path("o"), drafter="dflash"), plan)] == [False, False]
    int8 = systems(EvalConfig(tasks=("latency",), target="q4", out=Path("o"), drafter="dflash", int8_head=True), plan)
    assert [(s.int4_head, s.int8_head) for s in int8] == [(False, True), (False, True)] and "(INT8 head)" in int8[0].label


@pytest.mark.parametrize("bits", [4, 8])
def test_serve_vllm_refuses_a_quantized_head(bits):
    from qfd.stages.serve import ServeConfig, run_vllm

    with pytest.raises(QfdError, match=f"--int{bits}-head applies to --engine qfd"):
        run_vllm(ServeConfig(target="x", engine="vllm", **{f"int{bits}_head": True}))


def test_eval_refuses_both_head_flags(tmp_path):
    from qfd.stages.eval import EvalConfig, validate

    with pytest.raises(QfdError, match="one of --int4-head or --int8-head"):
        validate(EvalConfig(tasks=("latency",), target="q4", out=tmp_path / "o", int4_head=True, int8_head=True))


def test_bench_int4_head_int8_measures_the_int8_head(monkeypatch, tmp_path):
    """bench_int4_head.py --int8 on the embedded SmolLM2-135M (2 prompts, 8 tokens): it runs end
    to end and reports the INT8 head's format and metrics (bounded, logits moved but not far)."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench_dir))  # the script imports its sibling bench_e2e
    spec = importlib.util.spec_from_file_location("bench_int4_head", bench_dir / "bench_int4_head.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "What is 2 + 2?"}\n{"question": "Name a colour."}\n')
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench_int4_head.py", "--prompts", str(prompts), "--num", "2",
                                      "--max-new-tokens", "8", "--device", "cpu", "--int8", "--out", str(out)])
    bench.main()
    result = json.loads(out.read_text())
    assert result["head_format"] == "int8 RTN symmetric g64"
    m = result["metrics"]
    assert 0.5 <= m["top1_agreement"] <= 1 and 0 < m["kl_dense_int4_nats"] < 0.01 and 0 < m["max_abs_logit_diff"] < 2
