"""INT4 formats: unpack -> repack is bit-exact, packing matches the reference libraries."""

from __future__ import annotations

import json

import pytest
import torch

from qfd.quant.formats import build_checkpoint, detect_format, load_quantized, save_quantized
from qfd.quant.formats._packing import AWQ_ORDER, pack_nibbles, unpack_nibbles
from qfd.quant.grid import dequantize, rtn_quantize
from qfd.stages.quantize import _to_format


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _all_tensors(directory):
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.mark.parametrize("order", [None, AWQ_ORDER])
def test_nibble_pack_roundtrip_and_bit31(order):
    values = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    values[0, :8] = 15  # a word with bit 31 set must survive the int32 wrap
    packed = pack_nibbles(values, order)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    assert int(packed[0, 0]) == -1
    assert torch.equal(unpack_nibbles(packed, order), values)


def test_awq_order_places_column_j_at_its_nibble():
    values = torch.arange(8, dtype=torch.uint8).reshape(1, 8)  # column c holds value c
    word = int(pack_nibbles(values, AWQ_ORDER)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == list(AWQ_ORDER)  # nibble i holds column AWQ_ORDER[i]


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_packing_matches_the_library(symmetric):
    ct = _ct_helpers()
    from qfd.quant.formats import compressed_tensors as fmt

    qw = rtn_quantize(torch.randn(48, 96), 32, symmetric=symmetric, scale_dtype=torch.bfloat16)
    qcfg = fmt.quantization_config(4, 32, symmetric, [])
    packed = fmt.pack(qw, qcfg)
    signed = qw.codes.to(torch.int8) if symmetric else (qw.codes.to(torch.int16) - 8).to(torch.int8)
    assert torch.equal(packed["weight_packed"], ct.pack_to_int32(signed, 4))
    if not symmetric:
        assert torch.equal(packed["weight_zero_point"], ct.pack_to_int32((qw.zeros.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0))
    back = fmt.unpack({**packed}, qcfg)
    assert torch.equal(dequantize(back), dequantize(qw))


CASES = [("compressed-tensors", True, 32), ("compressed-tensors", False, 64), ("compressed-tensors", True, 128), ("awq", False, 32), ("awq", False, 128), ("gptq", True, 64), ("gptq", False, 32)]


@pytest.mark.parametrize("format_name,symmetric,group_size", CASES)
def test_unpack_repack_is_bit_exact(tmp_path, format_name, symmetric, group_size):
    from tests.tiny import make_tiny_checkpoint

    sizes = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4) if group_size == 128 else {}
    src = make_tiny_checkpoint("llama", tmp_path / "dense", **sizes)
    from safetensors.torch import load_file

    dense = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    scale_dtype = torch.bfloat16 if format_name == "compressed-tensors" else torch.float16
    qweights = {}
    for name, tensor in dense.items():
        if ".layers." in name and name.endswith("proj.weight"):
            qw = rtn_quantize(tensor, group_size, symmetric=symmetric, scale_dtype=scale_dtype)
            if format_name == "gptq" and not symmetric:
                qw.zeros = qw.zeros.clamp(min=1)  # v1 cannot store a zero point of 0
            qweights[name[: -len(".weight")]] = _to_format(qw, format_name)
    ckpt = build_checkpoint(format_name, config, dense, qweights, bits=4, group_size=group_size, symmetric=symmetric)
    save_quantized(tmp_path / "a", ckpt)
    first = load_quantized(tmp_path / "a")
    assert first.format == format_name == detect_format(first.config)
    for path, qw in qweights.items():  # what we packed is what we read
        assert torch.equal(dequantize(first.qweights[path]), dequantize(qw))
    save_quantized(tmp_path / "b", first)
    a, b = _all_tensors(tmp_path / "a"), _all_tensors(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(_bitwise(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads((tmp_path / "b" / "config.json").read_text())


def test_gptq_v1_zero_point_minus_one_convention():
    from qfd.quant.formats import gptq

    qw = rtn_quantize(torch.randn(16, 64), 32, symmetric=True)
    packed = gptq.pack(qw, gptq.quantization_config(4, 32, True, []))
    assert (packed["qzeros"] == 0x77777777).all()  # z = 8 stored as 7 in every nibble
    back = gptq.unpack(packed, gptq.quantization_config(4, 32, True, []))
    assert (back.zeros == 8).all() and torch.equal(dequantize(back), dequantize(qw))
    assert torch.equal(packed["g_idx"], torch.arange(64, dtype=torch.int32) // 32)


def test_unsupported_scheme_is_a_user_error(tmp_path):
    from qfd.errors import QfdError
    from qfd.quant.formats import format_scheme

    with pytest.raises(QfdError, match="group size"):
        format_scheme({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 96, "checkpoint_format": "gptq"}})
    with pytest.raises(QfdError, match="bit width"):
        format_scheme({"quantization_config": {"quant_method": "awq", "bits": 3, "group_size": 128, "version": "gemm"}})
    with pytest.raises(QfdError, match="not supported"):
        format_scheme({"quantization_config": {"quant_method": "bitsandbytes"}})


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptqmodel_written_checkpoints_roundtrip_and_dequantize_right(tmp_path, method, embedded_model_dir):
    """Files written by gptqmodel itself (GPTQ v1 / AWQ GEMM): bit-exact repack, and the
    dequantized model stays close to the source (a wrong nibble order would not)."""
    pytest.importorskip("gptqmodel")
    from transformers import AutoModelForCausalLM

    from qfd.models.hf import load_hf_causal_lm
    from qfd.quant.calibrate import gptqmodel_awq
    from tests.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint("llama", tmp_path / "dense", hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4, vocab_size=49152, tokenizer_from=embedded_model_dir)
    texts = [json.loads(line)["question"] for line in _gsm8k().read_text().splitlines()[:16]]
    if method == "awq":
        out = gptqmodel_awq(src, tmp_path / "q", texts, 32)
    else:
        from gptqmodel import GPTQModel, QuantizeConfig

        model = GPTQModel.load(str(src), QuantizeConfig(bits=4, group_size=32, sym=True, desc_act=False, pack_impl="original"))
        model.quantize(texts, batch_size=4)
        model.save(str(tmp_path / "q"))
        out = tmp_path / "q"
    ckpt = load_quantized(out)
    assert ckpt.format == method
    save_quantized(tmp_path / "rt", ckpt)
    a, b = _all_tensors(out), _all_tensors(tmp_path / "rt")
    assert a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        x = ref(ids).logits.flatten()
        y = load_hf_causal_lm(out)(ids).logits.flatten()
    assert torch.corrcoef(torch.stack([x, y]))[0, 1] > 0.95


def _gsm8k():
    from tests.conftest import SHARED_DATA

    path = SHARED_DATA / "gsm8k" / "train.jsonl"
    if not path.is_file():
        pytest.skip("no GSM8K data")
    return path


def _ct_helpers():
    """compressed_tensors' pack helpers, loaded from their file (importing the package pulls
    in torchao and takes long); skip when the library is absent."""
    import importlib.util

    spec = importlib.util.find_spec("compressed_tensors")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compressed-tensors not installed")
    from pathlib import Path

    path = Path(list(spec.submodule_search_locations)[0]) / "compressors" / "pack_quantized" / "helpers.py"
    helper_spec = importlib.util.spec_from_file_location("_ct_pack_helpers", path)
    module = importlib.util.module_from_spec(helper_spec)
    helper_spec.loader.exec_module(module)
    return module
