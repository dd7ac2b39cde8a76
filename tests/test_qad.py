"""QAD on tiny models: fake-quant student == INT4 checkpoint, grid kept bit-exact, resume,
bad input rejected before training (exit code 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qfd.quant.formats import load_quantized


def _cli(*args: str) -> int:
    from qfd.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.fixture(scope="module")
def qad_inputs(tmp_path_factory, tiny_chat_checkpoints, gsm8k_dir):
    """(teacher dir, INT4 dir, data file): tiny Llama with the SmolLM2 tokenizer, RTN group 32."""
    from qfd.stages.quantize import QuantizeConfig, run

    root = tmp_path_factory.mktemp("qad")
    data = root / "data.jsonl"
    data.write_text("".join((gsm8k_dir / "train.jsonl").read_text().splitlines(keepends=True)[:60]))
    teacher = tiny_chat_checkpoints["llama"]
    int4, _ = run(QuantizeConfig(model=str(teacher), out=root / "int4", method="rtn", group_size=32, format="compressed-tensors", symmetric=False))
    return teacher, int4, data


def test_fake_quant_student_equals_dequantized_int4_forward(qad_inputs):
    from qfd.models.hf import load_hf_causal_lm, load_hf_int4_runtime
    from qfd.qad_trainer import FakeQuantLinear, attach_fake_quant

    _, int4, _ = qad_inputs
    ckpt = load_quantized(int4)
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    dense = load_hf_causal_lm(int4, ckpt=ckpt)
    with torch.no_grad():
        reference = dense(ids).logits
        attach_fake_quant(dense, ckpt.qweights)
        assert isinstance(dense.get_submodule("model.layers.0.mlp.up_proj"), FakeQuantLinear)
        assert torch.equal(dense(ids).logits, reference)  # latents sit exactly on the grid
        runtime = load_hf_int4_runtime(int4, ckpt=ckpt)(ids).logits
    torch.testing.assert_close(runtime, reference, rtol=1e-4, atol=1e-4)
    trainable = [n for n, p in dense.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith("proj.weight") for n in trainable)  # only latents train


def test_qad_keeps_every_scale_and_zero_bitwise(qad_inputs, tmp_path):
    teacher, int4, data = qad_inputs
    out = tmp_path / "qad"
    # the teacher comes from the INT4 checkpoint's lineage (no --teacher)
    code = _cli("qad", "--ckpt", int4, "--out", out, "--data", data, "--steps", 3, "--seq-len", 32, "--batch-size", 2, "--eval-every", 2, "--eval-blocks", 2, "--lr", "3e-3", "--device", "cpu")
    assert code == 0
    before, after = load_quantized(int4), load_quantized(out)
    assert after.format == before.format == "compressed-tensors"
    changed = 0
    for path, old in before.qweights.items():
        new = after.qweights[path]
        assert torch.equal(old.scales.view(torch.int16), new.scales.view(torch.int16)) and old.scales.dtype == new.scales.dtype
        assert torch.equal(old.zeros, new.zeros)
        assert int(new.codes.min()) >= 0 and int(new.codes.max()) <= 15
        changed += int((old.codes != new.codes).sum())
    assert changed > 0  # training moved some weights to other grid points
    for name, tensor in before.other.items():  # norms / embeddings untouched
        assert torch.equal(tensor, after.other[name])
    manifest = json.loads((out / "qfd.json").read_text())
    roles = {p["role"]: p["path"] for p in manifest["parents"]}
    assert roles == {"student_init": str(Path(int4).resolve()), "teacher": str(Path(teacher).resolve())}
    metrics = manifest["metrics"]
    assert metrics["sanity_passed"] and metrics["sanity_student_kl"] == pytest.approx(metrics["sanity_int4_kl"], rel=1e-3)
    assert {"kl_before", "kl_after", "ppl_before", "ppl_after"} <= set(metrics)
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["quantization_config"] == json.loads((Path(int4) / "config.json").read_text())["quantization_config"]

    # It loads where the input loads: transformers' compressed-tensors path decompresses it to
    # the same logits as qfd's INT4 runtime.
    from transformers import AutoModelForCausalLM

    from qfd.models.loading import load_target

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    runtime, _ = load_target(out, "cpu", torch.float32, tokenizer=False)
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = runtime(ids, runtime.new_cache(16)).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_resumed_training_equals_uninterrupted(qad_inputs, tmp_path):
    from qfd.models.hf import load_hf_causal_lm, load_tokenizer
    from qfd.qad_data import load_documents, split_blocks
    from qfd.qad_trainer import Evaluator, QadTrainer, TrainSettings, attach_fake_quant

    teacher_dir, int4, data = qad_inputs
    teacher = load_hf_causal_lm(teacher_dir)
    train, held = split_blocks(load_documents(data, load_tokenizer(teacher_dir)), 32, 2, max_eval_blocks=1)
    evaluator = Evaluator(teacher, held, torch.device("cpu"), 512)

    def trainer(steps, state):
        ckpt = load_quantized(int4)
        student = load_hf_causal_lm(int4, ckpt=ckpt)
        latents = attach_fake_quant(student, ckpt.qweights)
        settings = TrainSettings(steps=4, lr=1e-3, batch_size=2, grad_accum=2, eval_every=0, save_every=1)
        t = QadTrainer(student, teacher, latents, train, evaluator, settings, state, torch.device("cpu"))
        t.load_state()
        t.run(until=steps)  # stop early, as an interrupted run would
        return t

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = trainer(4, tmp_path / "a")
    trainer(2, tmp_path / "b")
    resumed = trainer(4, tmp_path / "b")
    assert resumed.step == 4
    for name, latent in straight.latents.items():
        torch.testing.assert_close(resumed.latents[name], latent, rtol=0, atol=1e-7)


def test_bad_inputs_exit_2_before_training(qad_inputs, tiny_checkpoints, tiny_chat_checkpoints, tmp_path, capsys):
    teacher, int4, data = qad_inputs
    common = ("--steps", 1, "--seq-len", 32, "--batch-size", 2, "--device", "cpu")
    assert _cli("qad", "--ckpt", teacher, "--teacher", teacher, "--out", tmp_path / "o1", "--data", data, *common) == 2
    assert "not an INT4 checkpoint" in capsys.readouterr().err
    assert _cli("qad", "--ckpt", int4, "--teacher", tiny_checkpoints["llama"], "--out", tmp_path / "o2", "--data", data, *common) == 2
    assert "vocabulary" in capsys.readouterr().err
    assert _cli("qad", "--ckpt", int4, "--teacher", tiny_chat_checkpoints["qwen3"], "--out", tmp_path / "o3", "--data", data, *common) == 2
    assert "differs" in capsys.readouterr().err
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "too short"}) + "\n")
    assert _cli("qad", "--ckpt", int4, "--out", tmp_path / "o4", "--data", short, *common) == 2
    assert "too short" in capsys.readouterr().err
    bad = tmp_path / "g96"
    shutil.copytree(int4, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 96
    (bad / "config.json").write_text(json.dumps(config))
    assert _cli("qad", "--ckpt", bad, "--out", tmp_path / "o5", "--data", data, *common) == 2
    assert "group size" in capsys.readouterr().err
    assert _cli("quantize", "--model", teacher, "--out", tmp_path / "o6", "--bits", 3) == 2
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3", "o5"))
