"""`qfd draft swa`: config fields, exactness of a window >= context, and transform order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qfd.errors import QfdError
from qfd.manifest import read_manifest, sha256_file, write_manifest
from qfd.models.drafter import DFlashConfig, DFlashDrafter
from qfd.models.drafter_io import config_from_hf, hf_config_dict, load_drafter, save_drafter
from qfd.stages.draft_swa import DraftSwaConfig, run, with_window

HIDDEN, TARGET_LAYERS, VOCAB = 64, 4, 512


def tiny_drafter_config(**overrides) -> DFlashConfig:
    """A drafter for tests/tiny.py's 4-layer, hidden-64, vocab-512 targets."""
    base = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=VOCAB, target_layer_ids=(1, 2), mask_token_id=VOCAB - 1,
                num_target_layers=TARGET_LAYERS, block_size=8)
    base.update(overrides)
    return DFlashConfig(**base)


def make_drafter_dir(path: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(tiny_drafter_config(**overrides))
    drafter.reset_parameters(std=0.1)  # larger than the default so attention is not uniform
    save_drafter(drafter, path, dtype=torch.float32)
    write_manifest(path, stage="draft-stage1", parents={}, config={}, metrics={})
    return path


def make_data_dir(path: Path, n: int = 12, length: int = 48, prompt: int = 8, seed: int = 0) -> Path:
    """A `qfd draft data`-shaped directory of random token sequences (fine for random targets)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    with open(path / "data.jsonl", "w") as handle:
        for i in range(n):
            ids = torch.randint(3, VOCAB - 1, (length,), generator=g).tolist()
            handle.write(json.dumps({"index": i, "prompt_ids": ids[:prompt], "response_ids": ids[prompt:]}) + "\n")
    write_manifest(path, stage="draft-data", parents={}, config={}, metrics={})
    return path


def run_drafter(drafter: DFlashDrafter, taps: torch.Tensor, first_token: int, embed, head):
    """append_context over all of `taps` [1, T, k*H], then one draft block at T: logits."""
    cache = drafter.new_cache(taps.shape[1] + drafter.block_size)
    drafter.append_context(cache, taps, 0)
    _, logits = drafter.draft(cache, first_token, taps.shape[1], embed=embed, head=head, return_logits=True)
    return logits


@pytest.fixture(scope="module")
def embed_head():
    torch.manual_seed(1)
    return torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def test_with_window_writes_hf_and_vllm_fields():
    cfg = json.loads(json.dumps(hf_config_dict(tiny_drafter_config(), torch.float32)))
    windowed = with_window(cfg, 1024)
    assert windowed["sliding_window"] == 1024 and windowed["use_sliding_window"] is True
    assert windowed["layer_types"] == ["sliding_attention"] * 2
    assert windowed["dflash_config"]["swa_window_size"] == 1024 and windowed["dflash_config"]["use_swa"] is True
    assert windowed["dflash_config"]["causal"] is False  # vLLM: sliding layers are causal unless told
    assert config_from_hf(windowed).sliding_window == 1024
    assert cfg["sliding_window"] is None  # pure: input untouched
    cleared = with_window(windowed, None)
    assert config_from_hf(cleared).sliding_window is None
    assert cleared["layer_types"] == ["full_attention"] * 2


def test_window_at_least_context_equals_full_attention_exactly(embed_head):
    embed, head = embed_head
    torch.manual_seed(2)
    full = DFlashDrafter(tiny_drafter_config()).eval()
    full.reset_parameters(std=0.1)
    taps = torch.randn(1, 40, 2 * HIDDEN)
    reference = run_drafter(full, taps, 5, embed, head)
    for window in (40, 41, 4096):
        windowed = DFlashDrafter(tiny_drafter_config(sliding_window=window)).eval()
        windowed.load_state_dict(full.state_dict())
        assert torch.equal(run_drafter(windowed, taps, 5, embed, head), reference)
    # the training path (all blocks in one forward under the block mask) too
    ids = torch.randint(0, VOCAB - 1, (40,))
    anchors = torch.tensor([3, 17, 30])
    windowed = DFlashDrafter(tiny_drafter_config(sliding_window=64)).eval()
    windowed.load_state_dict(full.state_dict())
    with torch.no_grad():
        assert torch.equal(windowed.forward_train(taps, ids, anchors, embed), full.forward_train(taps, ids, anchors, embed))


def test_smaller_window_changes_logits_and_ignores_far_context(embed_head):
    embed, head = embed_head
    torch.manual_seed(3)
    full = DFlashDrafter(tiny_drafter_config()).eval()
    full.reset_parameters(std=0.1)
    windowed = DFlashDrafter(tiny_drafter_config(sliding_window=8)).eval()
    windowed.load_state_dict(full.state_dict())
    taps = torch.randn(1, 40, 2 * HIDDEN)
    assert not torch.allclose(run_drafter(windowed, taps, 5, embed, head), run_drafter(full, taps, 5, embed, head))
    # only the last W context tokens matter: changing older ones changes nothing
    perturbed = taps.clone()
    perturbed[:, :32] = torch.randn(1, 32, 2 * HIDDEN)
    assert torch.equal(run_drafter(windowed, perturbed, 5, embed, head), run_drafter(windowed, taps, 5, embed, head))


def test_swa_stage_copies_weights_and_records_transform(tmp_path):
    src = make_drafter_dir(tmp_path / "drafter")
    out = run(DraftSwaConfig(drafter=src, window=16, out=tmp_path / "swa"))
    assert sha256_file(out / "model.safetensors") == sha256_file(src / "model.safetensors")
    manifest = read_manifest(out)
    assert manifest["stage"] == "draft-swa"
    assert manifest["config"]["transforms"] == ["swa"]
    assert [p["role"] for p in manifest["parents"]] == ["drafter"]
    drafter = load_drafter(out)
    assert drafter.cfg.sliding_window == 16
    torch.testing.assert_close(drafter.state_dict(), load_drafter(src).state_dict(), rtol=0, atol=0)
    # inputs are never modified
    assert load_drafter(src).cfg.sliding_window is None


def test_swa_user_errors(tmp_path, tiny_checkpoints):
    src = make_drafter_dir(tmp_path / "drafter")
    with pytest.raises(QfdError, match="at least 1"):
        run(DraftSwaConfig(drafter=src, window=0, out=tmp_path / "o1"))
    with pytest.raises(QfdError, match="needs --target and --data"):
        run(DraftSwaConfig(drafter=src, window=16, out=tmp_path / "o2", train_steps=3))
    with pytest.raises(QfdError, match="not a DFlash drafter"):
        run(DraftSwaConfig(drafter=tiny_checkpoints["llama"], window=16, out=tmp_path / "o3"))
    with pytest.raises(QfdError, match="differ"):
        run(DraftSwaConfig(drafter=src, window=16, out=src))


def test_swa_fine_tune_runs_with_the_window(tmp_path, tiny_checkpoints):
    src = make_drafter_dir(tmp_path / "drafter")
    data = make_data_dir(tmp_path / "data", n=6, length=40)
    out = run(DraftSwaConfig(drafter=src, window=12, out=tmp_path / "swa", train_steps=2, target=str(tiny_checkpoints["llama"]), data=data, device="cpu"))
    manifest = read_manifest(out)
    assert manifest["metrics"]["fine_tune"]["steps"] == 2
    assert manifest["metrics"]["expected_acceptance_length_after"] >= 1.0
    assert {p["role"] for p in manifest["parents"]} == {"drafter", "target"}
    assert load_drafter(out).cfg.sliding_window == 12
    assert sha256_file(out / "model.safetensors") != sha256_file(src / "model.safetensors")
