"""qfd's runtime target model against transformers' implementation of the same checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from qfd.errors import QfdError
from qfd.models.loading import load_target
from tests.tiny import FAMILIES

ATOL = 1e-4


def _hf(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pairs(tiny_checkpoints):
    """family -> (runtime model, transformers model) of the same tiny checkpoint."""
    return {family: (load_target(path)[0], _hf(path)) for family, path in tiny_checkpoints.items()}


def _ids(batch=2, length=37, vocab=512, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_full_forward_logits_and_taps_match_transformers(pairs, family):
    model, hf = pairs[family]
    ids = _ids()
    ref = hf(ids, output_hidden_states=True)
    layers = tuple(range(model.config.num_hidden_layers))
    out = model(ids, tap_layers=layers)
    assert out.logits.shape == ref.logits.shape
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    hidden = model.config.hidden_size
    for slot, layer in enumerate(layers):
        torch.testing.assert_close(out.taps[..., slot * hidden : (slot + 1) * hidden], ref.hidden_states[layer + 1], atol=ATOL, rtol=0)
    # embed / head: the pieces the drafter uses; head does not apply the final norm
    torch.testing.assert_close(model.embed(ids), ref.hidden_states[0], atol=0, rtol=0)
    torch.testing.assert_close(model.head(ref.hidden_states[-1]), ref.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_taps_come_in_the_requested_order(pairs, family):
    model, _ = pairs[family]
    ids = _ids(batch=1, length=9)
    hidden = model.config.hidden_size
    a = model(ids, tap_layers=(2, 0)).taps
    b = model(ids, tap_layers=(0, 2)).taps
    torch.testing.assert_close(a[..., :hidden], b[..., hidden:], atol=0, rtol=0)
    assert model(ids).taps is None
    with pytest.raises(ValueError):
        model(ids, tap_layers=(model.config.num_hidden_layers,))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_incremental_decoding_equals_full_forward(pairs, family):
    """Chunked prefill (> max_verify tokens), 1-token steps, then a 16-token verify block."""
    model, _ = pairs[family]
    ids = _ids(length=20 + 3 + 16)
    full = model(ids, tap_layers=(1,))
    cache = model.new_cache(64, batch=2)
    pieces = [model(ids[:, :20], cache, tap_layers=(1,))]
    pieces += [model(ids[:, t : t + 1], cache, tap_layers=(1,)) for t in range(20, 23)]
    pieces.append(model(ids[:, 23:], cache, tap_layers=(1,)))
    assert cache.length == ids.shape[1]
    torch.testing.assert_close(torch.cat([p.logits for p in pieces], 1), full.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([p.taps for p in pieces], 1), full.taps, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("static", [False, True])
@torch.no_grad()
def test_a_prompt_continuing_a_cache_sees_its_context(pairs, family, static):
    """Two prompt-sized forwards in a row (each > max_verify tokens: fused attention over the
    filled keys, the second from position 20 under a mask) equal one full forward."""
    model, _ = pairs[family]
    ids = _ids(length=20 + 24)
    full = model(ids).logits
    cache = model.new_cache(64, batch=2, static=static)
    assert cache.prompt_start(20) == 0 and cache.prompt_start(16) is None
    first = model(ids[:, :20], cache).logits
    second = model(ids[:, 20:], cache).logits
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_last_only_and_static_cache(pairs, family):
    model, _ = pairs[family]
    ids = _ids(batch=1, length=12)
    full = model(ids).logits
    dynamic, static = model.new_cache(32), model.new_cache(32, static=True)
    for cache in (dynamic, static):
        out = model(ids[:, :8], cache, last_only=True).logits
        assert out.shape == (1, 1, model.config.vocab_size)
        torch.testing.assert_close(out[:, 0], full[:, 7], atol=ATOL, rtol=0)
        torch.testing.assert_close(model(ids[:, 8:], cache).logits, full[:, 8:], atol=ATOL, rtol=0)


@torch.no_grad()
def test_a_steps_keys_are_built_once_per_forward_as_each_layer_built_them(pairs):
    """StepKeys (once per forward): a step's slots are its positions, a key is visible to a query
    at a position not after it, the key count is the last slot + 1; a prompt (more tokens than a
    step takes) and a forward without a cache get None (SDPA / prompt attention)."""
    from qfd.models.target import step_keys

    model, _ = pairs["qwen3_5"]
    cache = model.new_cache(32, static=True, max_verify=4)
    cache.begin(3)
    positions = torch.tensor([0, 1, 2])
    keys = step_keys(cache, positions, None)
    assert torch.equal(keys.slots, positions) and torch.equal(keys.key_count, torch.tensor([3]))
    assert keys.visible.shape == (3, 32) and torch.equal(keys.visible, torch.arange(32)[None, :] <= positions[:, None])
    assert step_keys(None, positions, None) is None
    cache = model.new_cache(32, static=True, max_verify=2)
    cache.begin(3)
    assert step_keys(cache, positions, None) is None  # 3 tokens > max_verify: a prompt


def _write_conditional_generation_checkpoint(tiny_dir, out):
    """The tiny Qwen3.5 text model in the full Qwen3_5ForConditionalGeneration layout."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_dir / "model.safetensors"))
    nested = {("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in state.items()}
    nested["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)  # ignored
    nested["mtp.fc.weight"] = torch.zeros(2, 2)  # ignored
    out.mkdir()
    save_file(nested, str(out / "model.safetensors"))
    text = json.loads((tiny_dir / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config))
    return out


@torch.no_grad()
def test_full_qwen3_5_checkpoint_layout_loads_the_text_model(pairs, tiny_checkpoints, tmp_path):
    directory = _write_conditional_generation_checkpoint(tiny_checkpoints["qwen3_5"], tmp_path / "full")
    model, tokenizer = load_target(directory)
    assert tokenizer is None
    ids = _ids(batch=1, length=10)
    torch.testing.assert_close(model(ids).logits, pairs["qwen3_5"][1](ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"use_sliding_window": True, "sliding_window": 16}, "sliding"),
    ],
)
def test_unsupported_config_values_are_named(tiny_checkpoints, tmp_path, change, words):
    directory = tmp_path / "bad"
    shutil.copytree(tiny_checkpoints["qwen3"], directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(change)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(QfdError, match=words):
        load_target(directory)


def test_weights_not_matching_config_are_a_user_error(tiny_checkpoints, tmp_path):
    directory = tmp_path / "wrong"
    shutil.copytree(tiny_checkpoints["llama"], directory)
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 5
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(QfdError, match="missing"):
        load_target(directory)


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_matches_transformers(embedded_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    ids = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    model, _ = load_target(embedded_model_dir)
    hf = _hf(embedded_model_dir)
    ref = hf(ids, output_hidden_states=True)
    out = model(ids, tap_layers=(1, 15, 28))
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    hidden = model.config.hidden_size
    torch.testing.assert_close(out.taps[..., hidden : 2 * hidden], ref.hidden_states[16], atol=ATOL, rtol=0)
    cache = model.new_cache(64)
    inc = [model(ids[:, :5], cache).logits] + [model(ids[:, t : t + 1], cache).logits for t in range(5, ids.shape[1])]
    torch.testing.assert_close(torch.cat(inc, 1), ref.logits, atol=ATOL, rtol=0)


def _write_int4_checkpoint(tiny_dir, out, format_name="compressed-tensors", symmetric=True):
    """RTN INT4 (group 32) of every decoder-layer linear of a tiny checkpoint."""
    from safetensors.torch import load_file

    from qfd.quant.formats import build_checkpoint, save_quantized
    from qfd.quant.grid import rtn_quantize

    state = load_file(str(tiny_dir / "model.safetensors"))
    qweights = {
        name[: -len(".weight")]: rtn_quantize(t, 32, symmetric=symmetric)
        for name, t in state.items()
        if name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2
    }
    config = json.loads((tiny_dir / "config.json").read_text())
    ckpt = build_checkpoint(format_name, config, state, qweights, bits=4, group_size=32, symmetric=symmetric)
    save_quantized(out, ckpt)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@torch.no_grad()
def test_int4_checkpoint_runs_with_int4_linears_and_matches_dequantized_transformers(tiny_checkpoints, tmp_path, family):
    pytest.importorskip("qfd.quant.int4_linear")
    from qfd.models.hf import load_hf_causal_lm
    from qfd.quant.int4_linear import Int4Linear

    directory = _write_int4_checkpoint(tiny_checkpoints[family], tmp_path / "int4")
    model, _ = load_target(directory)
    swapped = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert swapped and not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    ids = _ids(batch=1, length=12)
    reference = load_hf_causal_lm(directory)(ids).logits
    torch.testing.assert_close(model(ids).logits, reference, atol=ATOL, rtol=0)
