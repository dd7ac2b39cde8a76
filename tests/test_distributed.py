"""Data-parallel training (qfd.distributed) with 2 gloo processes on CPU equals the single-process
run: the drafter trainer, the QAD trainer, `qfd draft train` and (slow) `qfd qad` under torchrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qfd.distributed import Dist
from tests.test_qad import qad_inputs  # noqa: F401 - the INT4 tiny checkpoint fixture

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


# --- runs shared by the reference (this process) and the 2 workers ----------------------------
def drafter_run(root: Path, dist: Dist) -> dict:
    """3 optimizer steps of 4 sequences each (rank r of 2 takes sequences r and r + 2)."""
    from qfd.drafter_trainer import FrozenTarget, TrainConfig, prepare_sequences, train_drafter
    from qfd.models.drafter import DFlashDrafter, config_for_target
    from qfd.models.hf import load_hf_causal_lm

    target_dir = root / "target"
    cfg = config_for_target(json.loads((target_dir / "config.json").read_text()), None, num_layers=1, block_size=4)
    records = [json.loads(line) for line in (root / "records.jsonl").read_text().splitlines()]
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    target = FrozenTarget(load_hf_causal_lm(target_dir), cfg.target_layer_ids)
    result = train_drafter(drafter, target, prepare_sequences(records, 512), TrainConfig(steps=3, grad_accum=4, lr=1e-3, max_anchors=8), progress=False, dist=dist)
    return {"params": drafter.state_dict(), "losses": [h["loss"] for h in result["history"]]}


def qad_run(root: Path, dist: Dist) -> dict:
    """3 QAD steps of 2 micro-batches x 2 rows (rank r of 2 takes rows r and r + 2)."""
    from qfd.models.hf import load_hf_causal_lm
    from qfd.qad_trainer import QadTrainer, TrainSettings, attach_fake_quant
    from qfd.quant.formats import load_quantized

    ckpt = load_quantized(root / "int4")
    student = load_hf_causal_lm(root / "int4", ckpt=ckpt)
    latents = attach_fake_quant(student, ckpt.qweights)
    settings = TrainSettings(steps=3, lr=1e-3, batch_size=2, grad_accum=2, eval_every=0, save_every=100)
    state = root / f"qad_state_{dist.world}"
    state.mkdir(exist_ok=True)
    trainer = QadTrainer(student, load_hf_causal_lm(root / "target"), latents, torch.load(root / "blocks.pt"), None, settings, state, torch.device("cpu"), dist=dist)
    losses = [trainer.train_step() for _ in range(settings.steps)]
    return {"params": {k: v.detach().clone() for k, v in latents.items()}, "losses": losses}


def _worker(root: str) -> None:
    """One torchrun-like rank: both runs, results to root/rank{r}.pt."""
    from qfd.distributed import init_from_env

    torch.set_num_threads(1)
    dist = init_from_env("cpu")
    assert dist.world == 2
    out = {"drafter": drafter_run(Path(root), dist), "qad": qad_run(Path(root), dist)}
    out["on_main"] = dist.on_main(lambda: f"made by rank {dist.rank}")
    try:
        dist.on_main(lambda: 1 / 0)
    except ZeroDivisionError:
        out["on_main_error"] = True
    torch.save(out, Path(root) / f"rank{dist.rank}.pt")


# --- fixtures ---------------------------------------------------------------------------------
def _rtn_int4(source: Path, out: Path) -> None:
    """An RTN INT4 (group 32, zero points) compressed-tensors copy (what `qfd quantize --method
    rtn` writes, minus the tokenizer the tiny model lacks)."""
    from safetensors.torch import load_file

    from qfd.models.hf import load_hf_causal_lm
    from qfd.quant import calibrate
    from qfd.quant.formats import build_checkpoint, save_quantized

    linears = calibrate.quantizable_linears(load_hf_causal_lm(source))
    qweights = {name: calibrate.rtn_quantize(m.weight, 32, 4, False, scale_dtype=torch.bfloat16) for name, m in linears.items()}
    config = json.loads((source / "config.json").read_text())
    out.mkdir()
    save_quantized(out, build_checkpoint("compressed-tensors", config, load_file(str(source / "model.safetensors")), qweights, bits=4, group_size=32, symmetric=False))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny random Llama (init std 0.1), its greedy texts, an RTN INT4 copy, random blocks."""
    from qfd.data import generate_responses
    from qfd.models.hf import load_hf_causal_lm
    from tests.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("dist")
    target_dir = make_tiny_checkpoint("llama", root / "target", initializer_range=0.1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist() for _ in range(12)]
    records = generate_responses(load_hf_causal_lm(target_dir), None, prompts, max_new_tokens=24, batch_size=12, progress=False)
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _rtn_int4(target_dir, root / "int4")
    torch.save(torch.randint(3, 500, (16, 24), generator=g), root / "blocks.pt")
    return root


@pytest.fixture(scope="module")
def two_ranks(inputs):
    """Both trainer runs in 2 gloo processes, started with torchrun's environment by hand."""
    port = str(_free_port())
    procs = [
        subprocess.Popen([sys.executable, "-c", f"from tests.test_distributed import _worker; _worker({str(inputs)!r})"], cwd=ROOT, env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:  # one rank failing can leave the other waiting in a collective
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]
    return [torch.load(inputs / f"rank{r}.pt") for r in range(2)]


def _assert_same_run(kind, distributed, single, initial):
    """Both ranks hold the same parameters, equal to the single-process run's, which moved."""
    moved = 0.0
    for name, ref in single["params"].items():
        torch.testing.assert_close(distributed[0][kind]["params"][name], distributed[1][kind]["params"][name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(distributed[0][kind]["params"][name], ref, rtol=0, atol=ATOL, msg=name)
        moved = max(moved, float((ref - initial[name]).abs().max()))
    assert moved > 100 * ATOL  # training changed the parameters: the comparison is not vacuous
    assert distributed[0][kind]["losses"] == distributed[1][kind]["losses"]
    assert distributed[0][kind]["losses"] == pytest.approx(single["losses"], rel=1e-5)


def test_drafter_two_ranks_equal_one_process(inputs, two_ranks):
    from qfd.models.drafter import DFlashDrafter, config_for_target

    torch.manual_seed(0)
    initial = DFlashDrafter(config_for_target(json.loads((inputs / "target" / "config.json").read_text()), None, num_layers=1, block_size=4)).state_dict()
    _assert_same_run("drafter", two_ranks, drafter_run(inputs, Dist()), initial)


def test_qad_two_ranks_equal_one_process(inputs, two_ranks):
    from qfd.models.hf import load_hf_causal_lm

    dense = load_hf_causal_lm(inputs / "int4").state_dict()  # the latents' start: dequantized INT4
    initial = {path: dense[path + ".weight"] for path in two_ranks[0]["qad"]["params"]}
    _assert_same_run("qad", two_ranks, qad_run(inputs, Dist()), initial)


def test_on_main_shares_rank0_result_and_error(two_ranks):
    assert [r["on_main"] for r in two_ranks] == ["made by rank 0"] * 2
    assert all(r.get("on_main_error") for r in two_ranks)  # raised on rank 1 too: no hang


def test_shard_and_single_process_defaults():
    two = [Dist(rank=r, world=2) for r in range(2)]
    assert two[0].shard(list("abcde")) == ["a", "c", "e"] and two[1].shard(list("abcde")) == ["b", "d"]
    single = Dist()
    assert single.is_main and single.shard([1, 2]) == [1, 2] and single.all_reduce_scalar(2.5) == 2.5
    assert single.on_main(lambda: 7) == 7


def test_draft_train_cli_under_torchrun_equals_one_process(inputs, tmp_path):
    """`torchrun --nproc-per-node 2 -m qfd draft train` writes the checkpoint a single process
    writes (same files, same weights within float summation order), and only one."""
    from safetensors.torch import load_file

    from qfd.checkpoint import Staging
    from qfd.cli import app
    from qfd.data import DATA_FILE, DATA_STAGE
    from qfd.manifest import read_manifest

    staging = Staging(tmp_path / "data")
    (staging.path / DATA_FILE).write_text((inputs / "records.jsonl").read_text())
    data = staging.commit(stage=DATA_STAGE, parents={"target": inputs / "target"})
    args = ["draft", "train", "--stage", "1", "--target", str(inputs / "target"), "--data", str(data), "--layers", "1", "--block-size", "4", "--steps", "3", "--grad-accum", "4", "--max-anchors", "8", "--eval-fraction", "0.2", "--device", "cpu"]
    app(args=[*args, "--out", str(tmp_path / "one")], standalone_mode=False)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "qfd", *args, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data-parallel over 2 ranks (gloo)" in proc.stderr
    assert proc.stderr.count("held-out sequences") == 1  # rank 1 is silent
    one, two = tmp_path / "one", tmp_path / "two"
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert not (tmp_path / "two.partial").exists()
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=ATOL, msg=name)
    m1, m2 = read_manifest(one)["metrics"], read_manifest(two)["metrics"]
    assert m2["steps"] == m1["steps"] == 3
    assert m2["final_train_loss"] == pytest.approx(m1["final_train_loss"], rel=1e-5)
    assert m2["expected_acceptance_length"] == pytest.approx(m1["expected_acceptance_length"], rel=1e-4)
    assert len([ln for ln in (two / "train_log.jsonl").read_text().splitlines() if ln]) == len([ln for ln in (one / "train_log.jsonl").read_text().splitlines() if ln])


@pytest.mark.slow  # the tiny model with SmolLM2's tokenizer (vocab 49152) `qfd qad` needs
def test_qad_cli_under_torchrun_equals_one_process(qad_inputs, tmp_path):
    """`torchrun --nproc-per-node 2 -m qfd qad` writes what one process writes: the same grid,
    the same codes up to rare rounding ties, the same metrics."""
    from qfd.cli import main
    from qfd.manifest import read_manifest
    from qfd.quant.formats import load_quantized

    _, int4, data = qad_inputs
    args = ["qad", "--ckpt", str(int4), "--data", str(data), "--steps", "3", "--seq-len", "32", "--batch-size", "2", "--grad-accum", "2", "--eval-every", "2", "--eval-blocks", "2", "--lr", "3e-3", "--device", "cpu"]
    main([*args, "--out", str(tmp_path / "one")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "qfd", *args, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data-parallel over 2 ranks (gloo)" in proc.stderr and proc.stderr.count("sanity ok") == 1
    one, two = load_quantized(tmp_path / "one"), load_quantized(tmp_path / "two")
    differing = total = changed = 0
    for path, a in one.qweights.items():
        b = two.qweights[path]
        assert torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)
        differing += int((a.codes != b.codes).sum())
        total += a.codes.numel()
    m1, m2 = read_manifest(tmp_path / "one")["metrics"], read_manifest(tmp_path / "two")["metrics"]
    assert m1["codes_changed"] > 100 * max(1, differing) and differing <= 1e-3 * total
    assert [h["train_kl"] for h in m2["history"]] == pytest.approx([h["train_kl"] for h in m1["history"]], rel=1e-5)
    assert m2["kl_after"] == pytest.approx(m1["kl_after"], rel=1e-3)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
