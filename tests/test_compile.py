"""torch.compile'd fixed-shape steps (StaticTargetSteps / StaticDraftStep(compile=True),
Engine(compile_steps=True), `--compile`): on the CPU they run without CUDA graphs and must
give exactly the uncompiled tokens, compiling each step function once (per size) at
construction and never again during generation (no recompiles, no graph breaks: fullgraph).

Most tests use the "aot_eager" backend: the same dynamo capture, guards and functionalised
graph as inductor, without code generation (seconds instead of a minute on 2 cores). One test
runs inductor itself on the dense target, the backend the GPU path uses."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from qfd.engine import Engine, GenerationConfig
from qfd.models.graphs import StaticDraftStep, StaticTargetSteps
from tests.test_engine import HYBRID_AND_DENSE, make_drafter, one_thread, targets  # noqa: F401 (fixtures)
from tests.test_graphs import TAPS, assert_steps_follow_the_dynamic_cache

NEW = 40  # new tokens per generation: ~39 verify steps with an untrained drafter


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled entries live on the code object (forward_at, _forward), shared by every
    compile in the process: start and leave each test with none, so counts and dynamo's
    recompile limit (8 per code object) concern this test only."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def counting(backend: str = "aot_eager"):
    """A backend that counts the graphs dynamo hands it (one per compile or recompile)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend(backend)


def prompts() -> list[list[int]]:
    torch.manual_seed(5)
    return [torch.randint(3, 500, (12,)).tolist(), torch.randint(3, 500, (7,)).tolist()]


def generate_all(engine: Engine, in_thread: bool = True) -> list[list[int]]:
    """Greedy tokens of every prompt; the last one from another thread (as the server's worker runs it)."""
    config = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    out = [engine.generate(ids, config).tokens for ids in prompts()]
    if in_thread:
        box = []
        worker = threading.Thread(target=lambda: box.append(engine.generate(prompts()[0], config).tokens))
        worker.start()
        worker.join()
        out.append(box[0])
    return out


@pytest.mark.parametrize("family", HYBRID_AND_DENSE)
def test_compiled_engine_is_token_identical_and_compiles_once_per_size(targets, tiny_checkpoints, family):
    target = targets[family]
    drafter = make_drafter(tiny_checkpoints[family], block_size=4)
    for d, graphs in ((drafter, 3), (None, 1)):  # speculative: sizes 1 and 4 + the draft step; target-only: size 1
        reference = generate_all(Engine(target, drafter=d, max_len=96))
        backend = counting()
        engine = Engine(target, drafter=d, max_len=96, compile_steps=True, compile_backend=backend)
        assert engine.forward.compiled and (d is None or engine.draft_step.compiled)
        assert backend.frame_count == graphs  # compiled at construction (warm-up), not in the first request
        got = generate_all(engine)
        assert got == reference
        assert backend.frame_count == graphs  # 3 generations, ~120 steps, two threads: no recompile


@pytest.mark.parametrize("family", HYBRID_AND_DENSE)
def test_compiled_target_steps_match_the_dynamic_cache_through_rollbacks(targets, family):
    """As tests/test_graphs.py, compiled: verify blocks kept in part (GDN states restored per
    position), then a decode step."""
    model = targets[family]
    static_cache = model.new_cache(128 + 16, static=True)
    backend = counting()
    steps = StaticTargetSteps(model, static_cache, sizes=(1, 16), tap_layers=TAPS, use_graphs=False, compile=True, compile_backend=backend)
    assert backend.frame_count == 2
    assert_steps_follow_the_dynamic_cache(model, steps, model.new_cache(128), static_cache)
    assert backend.frame_count == 2


def test_compiled_draft_step_matches_draft(targets, tiny_checkpoints):
    model = targets["llama"]
    for window in (None, 8):
        drafter = make_drafter(tiny_checkpoints["llama"])
        drafter.cfg = drafter.cfg.with_(sliding_window=window)
        cache = drafter.new_cache(64)
        backend = counting()
        step = StaticDraftStep(drafter, cache, embed=model.embed, head=model.head, use_graphs=False, num_drafts=5, compile=True, compile_backend=backend)
        torch.manual_seed(0)
        taps = torch.randn(1, 40, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size)
        drafter.append_context(cache, taps[:, :5], 0)
        with torch.inference_mode():
            for start in (5, 17, 30):
                if start > cache.length:
                    drafter.append_context(cache, taps[:, cache.length : start], cache.length)
                assert torch.equal(step(7, start), drafter.draft(cache, 7, start, embed=model.embed, head=model.head, num_drafts=5))
        assert backend.frame_count == 1, window


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor's CPU code generation needs a C++ compiler")
def test_inductor_compiled_engine_is_token_identical(targets, tiny_checkpoints):
    """The backend the GPU path uses, for real: inductor's fused kernels (here C++) over the
    static cache - in-place KV writes and all - emit the uncompiled tokens (float32). 20-35 s on
    2 cores (three compiles; less with inductor's on-disk cache warm)."""
    target = targets["llama"]
    drafter = make_drafter(tiny_checkpoints["llama"], block_size=4)
    reference = generate_all(Engine(target, drafter=drafter, max_len=96), in_thread=False)
    backend = counting("inductor")
    engine = Engine(target, drafter=drafter, max_len=96, compile_steps=True, compile_backend=backend)
    assert backend.frame_count == 3
    assert generate_all(engine, in_thread=False) == reference
    assert backend.frame_count == 3


def test_generate_compile_flag_gives_the_same_text(tiny_chat_checkpoints, capsys, monkeypatch):
    """`qfd generate --compile` builds Engine(compile_steps=True) and prints what the plain run
    prints (the backend swapped for aot_eager here, to keep the test short)."""
    import qfd.engine
    from tests.test_generate_cli import _run_cli

    seen = []

    class Recording(qfd.engine.Engine):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("compile_steps", False))
            if kwargs.get("compile_steps"):
                kwargs["compile_backend"] = "aot_eager"
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(qfd.engine, "Engine", Recording)
    args = ["--target", str(tiny_chat_checkpoints["llama"]), "--prompt", "The capital of France is", "--max-new-tokens", "12"]
    code, plain, _ = _run_cli(args, capsys)
    code_compiled, compiled, err = _run_cli([*args, "--compile"], capsys)
    assert code == code_compiled == 0 and seen == [False, True]
    assert compiled == plain and plain.strip() and "compiling the fixed-shape steps" in err


def test_compile_flag_user_errors(tiny_checkpoints, capsys):
    from qfd.cli import main

    target = str(tiny_checkpoints["llama"])
    for argv, words in ((["eval", "ifeval", "--target", target, "--backend", "hf", "--compile"], "--compile applies to qfd's engine"),
                        (["serve", "--target", target, "--engine", "vllm", "--compile"], "--compile applies to --engine qfd")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err and "Traceback" not in err, err
