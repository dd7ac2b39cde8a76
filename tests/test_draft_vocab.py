"""The draft vocabulary (qfd.draft_vocab, Engine(draft_vocab=N), `--draft-vocab`, `qfd draft
vocab`): token counts and top ids, the drafter's head over a subset mapped back to vocabulary
ids, greedy output equal to target-only even when the subset excludes every token the target
emits, sampled output still the target's distribution, the trainer writing the counts, the
CLI round trip, and one-line errors."""

from __future__ import annotations

import contextlib

import json
import shutil

import pytest
import torch

from qfd.checkpoint import DRAFT_VOCAB_NAME, inspect_model_dir
from qfd.draft_vocab import DraftVocabHead, count_tokens, coverage, load_counts, save_counts, top_ids
from qfd.engine import Engine
from qfd.errors import QfdError
from qfd.models.graphs import StaticDraftStep
from qfd.speculative import SamplingParams, target_probs, verify_sampling
from tests.test_drafter_train import _data_dir, tiny_setup  # noqa: F401 (fixture)
from tests.test_export import int4_target  # noqa: F401 (fixture)
from tests.test_engine import HYBRID_AND_DENSE, assert_first_two_tokens_follow_the_target, greedy, make_drafter, one_thread, prompt_ids, reference, targets  # noqa: F401 (fixtures)
from tests.test_speculative import _chi2_pvalue

V = 512  # the tiny checkpoints' vocabulary


def with_counts(drafter, counts):
    drafter.draft_vocab_counts = torch.as_tensor(counts, dtype=torch.int64)
    return drafter


# --- counts and top ids -----------------------------------------------------------------------
def test_counts_cover_response_tokens_only_and_top_ids_rank_them():
    records = [{"prompt_ids": [9, 9, 9], "response_ids": [5, 3, 5, 7]}, {"prompt_ids": [9], "response_ids": [3, 5]}, {"prompt_ids": [1], "response_ids": []}]
    counts = count_tokens(records, 10)
    assert counts.dtype == torch.int64 and counts.tolist() == [0, 0, 0, 2, 0, 3, 0, 1, 0, 0]  # prompt tokens not counted
    assert top_ids(counts, 3).tolist() == [5, 3, 7]
    # beyond the ids that occur: every occurring id first, then the others by ascending id
    assert top_ids(counts, 6).tolist() == [5, 3, 7, 0, 1, 2]
    assert top_ids(torch.tensor([4, 1, 4, 0, 1]), 5).tolist() == [0, 2, 1, 4, 3]  # ties by id
    assert top_ids(counts, 10).sort().values.tolist() == list(range(10))
    for bad in (0, 11, -1):
        with pytest.raises(QfdError, match=r"--draft-vocab must be in 1\.\.10"):
            top_ids(counts, bad)
    assert coverage(counts, 1) == 0.5 and coverage(counts, 3) == 1.0
    with pytest.raises(QfdError, match="outside the drafter's vocabulary of 6"):
        count_tokens(records, 6, source="--data X")


def test_counts_file_round_trip_and_drafter_dirs_with_and_without_it(tmp_path, tiny_checkpoints):
    from qfd.models.drafter import load_drafter, save_drafter

    drafter = make_drafter(tiny_checkpoints["llama"])
    save_drafter(drafter, tmp_path / "d", torch.float32)
    plain = load_drafter(tmp_path / "d")
    assert plain.draft_vocab_counts is None  # a drafter without the file stays valid
    counts = torch.randint(0, 50, (V,))
    save_counts(counts, tmp_path / "d")
    assert torch.equal(load_counts(tmp_path / "d"), counts)
    assert [p.name for p in inspect_model_dir(tmp_path / "d").weight_files] == ["model.safetensors"]  # counts are not weights
    loaded = load_drafter(tmp_path / "d")
    assert torch.equal(loaded.draft_vocab_counts, counts)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    with pytest.raises(QfdError, match="counts 512 ids, the drafter's vocabulary has 7"):
        load_counts(tmp_path / "d", vocab_size=7)


# --- the head over a subset -------------------------------------------------------------------
def test_draft_over_a_subset_is_the_full_logits_argmax_within_it(targets, tiny_checkpoints):
    target = targets["llama"]
    drafter = make_drafter(tiny_checkpoints["llama"])
    cache = drafter.new_cache(64)
    torch.manual_seed(3)
    drafter.append_context(cache, torch.randn(1, 20, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size), 0)
    _, full = drafter.draft(cache, 7, 20, embed=target.embed, head=target.head, return_logits=True)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40]
    head = DraftVocabHead.of_target(target, ids)
    assert head.weight.shape == (40, target.config.hidden_size) and head.weight.is_contiguous()
    for k in (2, 7):
        tokens, logits = drafter.draft(cache, 7, 20, embed=target.embed, head=head, return_logits=True, num_drafts=k)
        assert torch.equal(tokens, ids[full[:, :k, ids].argmax(-1)])  # the subset's argmax, as vocabulary ids
        assert set(tokens.view(-1).tolist()) <= set(ids.tolist())
        torch.testing.assert_close(logits[..., ids], full[:, :k, ids], atol=1e-5, rtol=1e-5)
        outside = torch.ones(V, dtype=torch.bool)
        outside[ids] = False
        assert torch.isneginf(logits[..., outside]).all()  # softmax: q = 0 outside the subset
        for compile_ in (False, True):  # the fixed-shape step (CUDA graphs on a GPU), also torch.compile'd
            step = StaticDraftStep(drafter, cache, embed=target.embed, head=head, use_graphs=False, num_drafts=k, compile=compile_, compile_backend="aot_eager")
            with torch.inference_mode():
                assert torch.equal(step(7, 20), tokens)


# --- the engine: greedy stays target-only, sampling stays the target's ---------------------------
@pytest.mark.parametrize("family", HYBRID_AND_DENSE)
@pytest.mark.parametrize("subset", ["top", "emitted_only", "excludes_emitted"])
def test_greedy_with_a_draft_vocab_equals_target_only(targets, tiny_checkpoints, reference, family, subset):
    target, emitted = targets[family], reference[family]
    if subset == "top":
        counts, n = torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(0)), 64
    elif subset == "emitted_only":
        counts = torch.bincount(torch.tensor(emitted), minlength=V)
        n = len(set(emitted))
    else:  # the drafter can never propose a token the target emits: every draft is rejected
        counts = torch.ones(V, dtype=torch.int64)
        counts[emitted] = 0
        n = V - len(set(emitted))
    for graphs in (False, True):
        drafter = with_counts(make_drafter(tiny_checkpoints[family]), counts)
        engine = Engine(target, drafter=drafter, max_len=128, draft_len=3, draft_vocab=n, cuda_graphs=graphs)
        assert isinstance(engine.draft_head, DraftVocabHead) and engine.draft_head.weight.shape[0] == n
        result = engine.generate(prompt_ids(), greedy())
        assert result.tokens == emitted
        if subset == "excludes_emitted":
            assert result.stats.tau == 1.0 and result.stats.accept_per_position == [0.0] * 3


def _first_two_supports(target, prompt, params):
    """The tokens the target may sample first, and for each the tokens it may sample second."""
    with torch.no_grad():
        p1 = target_probs(target(torch.tensor([prompt])).logits[0, -1], params)
        firsts = p1.nonzero().view(-1).tolist()
        seconds = {t1: target_probs(target(torch.tensor([prompt + [t1]])).logits[0, -1], params).nonzero().view(-1).tolist() for t1 in firsts}
    return max(firsts, key=lambda t: float(p1[t])), seconds


@pytest.mark.parametrize("subset", ["inside", "outside"])
def test_sampling_with_a_draft_vocab_follows_the_target(targets, tiny_checkpoints, subset):
    """inside: the subset is the support of the second token after the likeliest first one, so
    drafts there are accepted sometimes; outside: no token the target can sample is in it, so
    every draft is rejected. The first two tokens follow the target either way (chi-square)."""
    target = targets["qwen3_5"]
    prompt = prompt_ids(8)
    likeliest, seconds = _first_two_supports(target, prompt, SamplingParams(temperature=1.5, top_k=3))
    counts = torch.zeros(V, dtype=torch.int64)
    if subset == "inside":
        counts[seconds[likeliest]] = 1
        n = len(seconds[likeliest])
    else:
        counts += 1
        counts[[t for ts in seconds.values() for t in ts] + list(seconds)] = 0
        n = int((counts > 0).sum())
    drafter = with_counts(make_drafter(tiny_checkpoints["qwen3_5"], block_size=4), counts)
    engine = Engine(target, drafter=drafter, max_len=64, draft_vocab=n)
    accepted = []
    engine.on_step = lambda state: accepted.append(state["accepted"])
    assert_first_two_tokens_follow_the_target(target, engine, prompt)
    if subset == "inside":
        assert 0 < sum(a > 0 for a in accepted) < len(accepted)
    else:
        assert sum(accepted) == 0


def test_rejection_sampling_with_q_zero_outside_a_subset_follows_the_target():
    """A stochastic drafter whose q comes from a draft-vocabulary head (scattered back, zero
    outside the subset): the committed token is still distributed as p."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    p = target_probs(logits, SamplingParams(1.2))
    ids = torch.tensor([1, 4, 6])
    head = DraftVocabHead(torch.randn(8, 5, generator=gen), ids)
    q = head.full_logits(head(torch.randn(2, 5, generator=gen))).softmax(-1)
    assert (q[:, [0, 2, 3, 5, 7]] == 0).all() and torch.allclose(q.sum(-1), torch.ones(2))
    first = torch.zeros(8)
    for _ in range(2500):
        draft = torch.multinomial(q, 1, generator=gen).view(-1)
        first[verify_sampling(draft, p, q, gen).tokens[0]] += 1
    assert _chi2_pvalue(first, p[0]) > 1e-3


def test_engine_refuses_a_draft_vocab_it_cannot_build(targets, tiny_checkpoints):
    target = targets["llama"]
    with pytest.raises(QfdError, match="needs a drafter"):
        Engine(target, max_len=32, draft_vocab=8)
    with pytest.raises(QfdError, match=r"has no draft vocabulary .*make one with `qfd draft vocab"):
        Engine(target, drafter=make_drafter(tiny_checkpoints["llama"]), max_len=32, draft_vocab=8)
    drafter = with_counts(make_drafter(tiny_checkpoints["llama"]), torch.ones(V))
    for bad in (0, V + 1):
        with pytest.raises(QfdError, match=rf"--draft-vocab must be in 1\.\.{V}"):
            Engine(target, drafter=drafter, max_len=32, draft_vocab=bad)
    engine = Engine(target, drafter=drafter, max_len=32)
    assert engine.draft_vocab is None and engine.draft_head == target.head  # the default: the full head


# --- the trainer and `qfd draft vocab` ----------------------------------------------------------
def _cli(argv, capsys):
    from qfd.cli import main

    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@contextlib.contextmanager
def served_engine(**config):
    """The engine of a `qfd serve` built (not started) from ServeConfig(**config) on the CPU,
    port 0, a 64-token context; the server is stopped afterwards."""
    from qfd.stages.serve import ServeConfig, build

    server = build(ServeConfig(port=0, device="cpu", max_len=64, **config))
    try:
        yield server.app.engine
    finally:
        server.app.worker.stop()
        server.server_close()


def _one_error_line(code, err, words):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, err


def test_trainer_writes_counts_and_draft_vocab_adds_them_to_an_older_drafter(tmp_path, tiny_setup, tiny_checkpoints, capsys):
    from qfd.manifest import read_manifest
    from qfd.models.drafter import load_drafter, verify_drafter_target

    target_dir, model, records = tiny_setup
    data = _data_dir(tmp_path / "data", target_dir, records[:20])
    extra = _data_dir(tmp_path / "extra", target_dir, records[20:])
    trained = tmp_path / "trained"
    code, _, err = _cli(["draft", "train", "--stage", 1, "--target", target_dir, "--data", data, "--extra-data", extra, "--out", trained,
                         "--layers", 1, "--block-size", 4, "--steps", 2, "--grad-accum", 1, "--max-anchors", 8, "--eval-fraction", 0.1], capsys)
    assert code == 0, err
    counts = load_counts(trained)
    assert torch.equal(counts, count_tokens(records, V))  # every response of --data and --extra-data
    assert read_manifest(trained)["files"][DRAFT_VOCAB_NAME]

    # A drafter trained before the counts existed: the same directory without the file.
    older = tmp_path / "older"
    shutil.copytree(trained, older)
    (older / DRAFT_VOCAB_NAME).unlink()
    manifest = read_manifest(trained)
    del manifest["files"][DRAFT_VOCAB_NAME]
    (older / "qfd.json").write_text(json.dumps(manifest))
    before = sorted((p.name, p.read_bytes()) for p in older.iterdir())
    out = tmp_path / "with_vocab"
    code, stdout, err = _cli(["draft", "vocab", "--drafter", older, "--data", data, "--data", extra, "--out", out], capsys)
    assert code == 0, err
    assert "distinct_tokens" in stdout
    assert torch.equal(load_counts(out), counts)
    assert sorted((p.name, p.read_bytes()) for p in older.iterdir()) == before  # the input is unchanged
    assert not (tmp_path / "with_vocab.partial").exists()
    manifest = read_manifest(out)
    assert manifest["stage"] == "draft-vocab" and {p["role"] for p in manifest["parents"]} == {"drafter", "target", "data-1", "data-2"}
    assert manifest["metrics"]["distinct_tokens"] == int((counts > 0).sum())
    verify_drafter_target(out, target_dir)  # still pinned to its target: serves without --allow-target-mismatch
    assert torch.equal(load_drafter(out).draft_vocab_counts, counts)
    engine = Engine(targets_of(target_dir), drafter=load_drafter(out), max_len=64, draft_vocab=16)
    assert engine.draft_head.vocab_ids.tolist() == top_ids(counts, 16).tolist()

    # A drafter trained on another machine: its pinned target path does not exist here, and the
    # pin (the target's fingerprint) carries over all the same.
    moved = tmp_path / "moved"
    shutil.copytree(older, moved)
    manifest = read_manifest(moved)
    for parent in manifest["parents"]:
        if parent["role"] == "target":
            parent["path"] = str(tmp_path / "elsewhere" / "target")
    (moved / "qfd.json").write_text(json.dumps(manifest))
    code, _, err = _cli(["draft", "vocab", "--drafter", moved, "--data", data, "--out", tmp_path / "moved_vocab"], capsys)
    assert code == 0, err
    verify_drafter_target(tmp_path / "moved_vocab", target_dir)

    # bad input: one error line each, nothing written
    _one_error_line(*_cli(["draft", "vocab", "--drafter", older, "--data", data, "--out", out], capsys)[::2], "--overwrite")
    code, _, err = _cli(["draft", "vocab", "--drafter", older, "--data", data, "--out", out, "--overwrite"], capsys)
    assert code == 0, err
    assert torch.equal(load_counts(out), count_tokens(records[:20], V))
    _one_error_line(*_cli(["draft", "vocab", "--drafter", tmp_path / "nope", "--data", data, "--out", tmp_path / "o1"], capsys)[::2], "does not exist")
    _one_error_line(*_cli(["draft", "vocab", "--drafter", older, "--data", tmp_path / "nope", "--out", tmp_path / "o2"], capsys)[::2], "does not exist")
    _one_error_line(*_cli(["draft", "vocab", "--drafter", older, "--data", older, "--out", tmp_path / "o3"], capsys)[::2], "not a finished drafter data directory")
    wide = [{"index": 0, "prompt_ids": [5], "response_ids": [7, 40000, 2]}]
    foreign = _data_dir(tmp_path / "foreign", tiny_checkpoints["qwen3"], wide)  # pinned to a 512-token model, ids beyond it
    _one_error_line(*_cli(["draft", "vocab", "--drafter", older, "--data", foreign, "--out", tmp_path / "o4"], capsys)[::2], "outside the drafter's vocabulary of 512")
    for name in ("o1", "o2", "o3", "o4", "o1.partial", "o4.partial"):
        assert not (tmp_path / name).exists()


def targets_of(directory):
    from qfd.models.loading import load_target

    return load_target(directory, tokenizer=False)[0]


def test_draft_vocab_refuses_data_of_another_vocabulary_size(tmp_path, tiny_checkpoints, tiny_chat_checkpoints, capsys):
    from qfd.manifest import write_manifest
    from qfd.models.drafter import save_drafter

    drafter = tmp_path / "drafter"
    save_drafter(make_drafter(tiny_checkpoints["llama"]), drafter, torch.float32)
    write_manifest(drafter, stage="test", parents={"target": tiny_checkpoints["llama"]})
    data = _data_dir(tmp_path / "chatdata", tiny_chat_checkpoints["llama"], [{"index": 0, "prompt_ids": [5], "response_ids": [7, 8]}])
    code, _, err = _cli(["draft", "vocab", "--drafter", drafter, "--data", data, "--out", tmp_path / "out"], capsys)
    _one_error_line(code, err, "vocabulary of 49152 tokens, the drafter's has 512")


# --- serving commands -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_drafters(tiny_chat_checkpoints, tmp_path_factory):
    """(target dir, drafter dir without counts, the same drafter with counts)."""
    from qfd.manifest import write_manifest
    from qfd.models.drafter import DFlashDrafter, config_for_target, save_drafter

    target = tiny_chat_checkpoints["llama"]
    root = tmp_path_factory.mktemp("draftvocab")
    torch.manual_seed(0)
    config = json.loads((target / "config.json").read_text())
    drafter = DFlashDrafter(config_for_target(config, num_layers=1, block_size=4, intermediate_size=64))
    for name in ("plain", "counted"):
        save_drafter(drafter, root / name, torch.float32)
        if name == "counted":
            save_counts(torch.arange(config["vocab_size"]) % 7, root / name)
        write_manifest(root / name, stage="test", parents={"target": target})
    return target, root / "plain", root / "counted"


def engine_command(command: str, target: str) -> list[str]:
    """The start of a generate / serve / eval command line on `target` (CPU), for flag checks."""
    return {"generate": ["generate", "--target", target, "--prompt", "hi", "--device", "cpu"],
            "serve": ["serve", "--target", target, "--device", "cpu", "--port", "0"],
            "eval": ["eval", "latency", "--target", target, "--device", "cpu"]}[command]


@pytest.mark.parametrize("command", ["generate", "serve", "eval"])
def test_cli_draft_vocab_errors_are_one_line(chat_drafters, capsys, command):
    target, plain, counted = map(str, chat_drafters)
    base = engine_command(command, target)
    cases = [(["--draft-vocab", "8"], "needs a drafter"), (["--drafter", plain, "--draft-vocab", "8"], "has no draft vocabulary"),
             (["--drafter", counted, "--draft-vocab", "0"], "--draft-vocab must be"), (["--drafter", counted, "--draft-vocab", "49153"], "must be in 1..49152")]
    for flags, words in cases:
        _one_error_line(*_cli([*base, *flags], capsys)[::2], words)


def test_cli_generate_and_serve_with_a_draft_vocab(chat_drafters, capsys):
    from qfd.stages.serve import ServeConfig

    target, plain, counted = map(str, chat_drafters)
    argv = ["generate", "--target", target, "--prompt", "Hello", "--max-new-tokens", "8", "--device", "cpu", "--drafter"]
    code, full_out, err = _cli([*argv, plain], capsys)
    assert code == 0, err
    code, out, err = _cli([*argv, counted, "--draft-vocab", "256"], capsys)
    assert code == 0, err
    assert out == full_out  # greedy: the same text with the full head and with 256 ids
    with served_engine(target=target, drafter=counted, draft_vocab=256) as engine:
        assert engine.draft_vocab == 256 and engine.draft_head.weight.shape[0] == 256
    with pytest.raises(QfdError, match="--engine qfd"):
        from qfd.stages.serve import run

        run(ServeConfig(target=target, drafter=counted, engine="vllm", draft_vocab=256))


# --- the counts travel with the drafter, and stay out of its weights ---------------------------
def test_counts_carry_through_quantize_and_swa_and_stay_out_of_weights(tmp_path, tiny_checkpoints):
    from qfd.quant.formats import load_quantized
    from qfd.quant.int4_linear import Int4Linear
    from qfd.stages.draft_quantize import load_drafter_any
    from qfd.stages.draft_swa import DraftSwaConfig
    from qfd.stages.draft_swa import run as run_swa
    from qfd.vllm_layout import drafter_problems
    from tests.test_draft_quantize import quantize
    from tests.test_draft_swa import make_data_dir, make_drafter_dir

    drafter = make_drafter_dir(tmp_path / "drafter")
    counts = torch.randint(0, 9, (V,), generator=torch.Generator().manual_seed(2))
    save_counts(counts, drafter)
    assert drafter_problems(drafter) == []  # vLLM's tensor-name check does not see the counts
    int4 = quantize(tmp_path, drafter, tiny_checkpoints["llama"], make_data_dir(tmp_path / "data", n=6, length=40), "int4")
    assert torch.equal(load_counts(int4), counts)
    assert "token_counts" not in load_quantized(int4).other
    loaded = load_drafter_any(int4)
    assert isinstance(loaded.fc, Int4Linear) and torch.equal(loaded.draft_vocab_counts, counts)
    windowed = run_swa(DraftSwaConfig(drafter=int4, window=64, out=tmp_path / "swa"))
    assert torch.equal(load_counts(windowed), counts)


def test_vllm_export_leaves_the_counts_out(tmp_path, int4_target):
    from tests.test_export import _cli as export_cli
    from tests.test_export import _drafter

    drafter = _drafter(int4_target, tmp_path / "drafter")
    save_counts(torch.ones(49152, dtype=torch.int64), drafter)
    out = tmp_path / "export"
    assert export_cli(["export", "vllm", "--target", str(int4_target), "--drafter", str(drafter), "--out", str(out)]) == 0
    assert (out / "drafter" / "model.safetensors").is_file() and not (out / "drafter" / DRAFT_VOCAB_NAME).exists()
