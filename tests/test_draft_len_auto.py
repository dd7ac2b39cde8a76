"""`--draft-len auto` (qfd.draft_len_auto): tau(k) from the recorded acceptance, the choice from
measured step costs, the engines it times, and its errors from the command line."""

from __future__ import annotations

import json

import pytest
import torch

from qfd.draft_len_auto import AUTO, auto_draft_len, choose, expected_tau, parse_draft_len
from qfd.engine import Engine, GenerationConfig
from qfd.errors import QfdError
from tests.test_draft_len import _cli


def test_parse_draft_len():
    assert parse_draft_len(None) is None and parse_draft_len(3) == 3
    assert parse_draft_len("5") == 5 and parse_draft_len(" Auto ") == AUTO
    with pytest.raises(QfdError, match="'auto'"):
        parse_draft_len("fast")


def test_expected_tau_multiplies_the_conditional_acceptance():
    acceptance = [0.5, 0.5, 0.0, 0.9]
    assert expected_tau(acceptance, 0) == 1.0
    assert expected_tau(acceptance, 1) == pytest.approx(1.5)
    assert expected_tau(acceptance, 2) == pytest.approx(1.75)
    assert expected_tau(acceptance, 4) == pytest.approx(1.75)  # nothing past a rejected position


def test_choose_takes_the_highest_projected_speedup():
    acceptance = [0.9] * 15
    # cheap short steps and an expensive full block: k = 3 wins (3.44 x 10 / 14 = 2.46x)
    choice = choose(acceptance, decode_ms=10.0, step_ms={1: 12.0, 3: 14.0, 15: 60.0})
    assert choice.k == 3
    assert [round(row["speedup"], 2) for row in choice.rows] == [1.58, 2.46, 1.36]
    # a launch-bound machine, every step about one decode: the whole block wins
    assert choose(acceptance, decode_ms=10.0, step_ms={1: 10.5, 3: 10.6, 15: 11.0}).k == 15


def test_auto_times_target_only_and_every_candidate(tiny_checkpoints):
    from tests.test_engine import make_drafter
    from qfd.models.loading import load_target

    target, _ = load_target(tiny_checkpoints["llama"], tokenizer=False)
    drafter = make_drafter(tiny_checkpoints["llama"])  # block 8: candidates 1, 2, 3, 4, 5, 7
    built = []

    def build(k):
        built.append(k)
        return Engine(target, drafter=drafter if k else None, max_len=64, draft_len=k)

    prompt = torch.randint(3, 500, (10,)).tolist()
    choice = auto_draft_len(build, [0.8] * 7, drafter.block_size, prompt, new_tokens=8)
    assert built == [None, 1, 2, 3, 4, 5, 7]
    assert [row["k"] for row in choice.rows] == [1, 2, 3, 4, 5, 7] and choice.k in (1, 2, 3, 4, 5, 7)
    assert choice.decode_ms > 0 and all(row["step_ms"] > 0 for row in choice.rows)
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    assert Engine(target, drafter=drafter, max_len=64, draft_len=choice.k).generate(prompt, config).tokens == Engine(target, max_len=64).generate(prompt, config).tokens


@pytest.fixture(scope="module")
def drafters(tiny_chat_checkpoints, tmp_path_factory):
    """(target dir, drafter recording its acceptance, drafter without): untrained, block 4."""
    from qfd.manifest import write_manifest
    from qfd.models.drafter import DFlashDrafter, config_for_target, save_drafter

    target = tiny_chat_checkpoints["llama"]
    config = json.loads((target / "config.json").read_text())
    out = []
    for name, metrics in (("recorded", {"conditional_acceptance_per_position": [0.6, 0.5, 0.4]}), ("bare", {})):
        directory = tmp_path_factory.mktemp("auto") / name
        torch.manual_seed(0)
        save_drafter(DFlashDrafter(config_for_target(config, num_layers=1, block_size=4, intermediate_size=64)), directory, torch.float32)
        write_manifest(directory, stage="test", parents={"target": target}, metrics=metrics)
        out.append(str(directory))
    return str(target), *out


def test_cli_generate_with_auto_prints_its_choice(drafters, capsys):
    target, recorded, _ = drafters
    code, out, err = _cli(["generate", "--target", target, "--prompt", "Hello", "--max-new-tokens", "8", "--device", "cpu", "--drafter", recorded, "--draft-len", "auto"], capsys)
    assert code == 0, err
    assert "--draft-len auto: k =" in out + err
    k = int((out + err).split("--draft-len auto: k =")[1].split()[0])
    rates = err.split("acceptance per draft position")[1].split()
    assert 1 <= k <= 3 and len(rates) == k, err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_auto_errors_are_one_line(drafters, capsys, command):
    target, recorded, bare = drafters
    base = {"generate": ["generate", "--target", target, "--prompt", "hi", "--device", "cpu"],
            "serve": ["serve", "--target", target, "--device", "cpu", "--port", "0"]}[command]
    for flags, words in ((["--drafter", bare, "--draft-len", "auto"], "records no held-out acceptance"),
                         (["--drafter", recorded, "--draft-len", "fast"], "'auto'"),
                         (["--draft-len", "auto"], "needs a drafter")):
        code, out, err = _cli([*base, *flags], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, (flags, err)


def test_engine_uses_cuda_graphs_by_default_only_on_a_gpu(tiny_checkpoints):
    from tests.test_engine import make_drafter
    from qfd.models.loading import load_target

    target, _ = load_target(tiny_checkpoints["llama"], tokenizer=False)
    engine = Engine(target, drafter=make_drafter(tiny_checkpoints["llama"]), max_len=32)
    assert not engine.cuda_graphs and engine.draft_step is None and engine.append_step is None  # the CPU: eager
    assert Engine(target, max_len=32, cuda_graphs=True).cuda_graphs
