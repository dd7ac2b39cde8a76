"""Shared fixtures: tiny random checkpoints of every family and the real embedded model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Never reach a hub at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> directory of a tiny random float32 checkpoint (vocab 512, no tokenizer)."""
    from tests.tiny import FAMILIES, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct checkpoint (converted once into the qfd cache)."""
    from qfd.embedded import ensure_embedded

    return ensure_embedded("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_chat_checkpoints(tmp_path_factory, embedded_model_dir):
    """Tiny random checkpoints that carry SmolLM2's tokenizer (vocab 49152), for CLI tests."""
    from tests.tiny import FAMILIES, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tinychat")
    return {
        family: make_tiny_checkpoint(family, root / family, vocab_size=49152, tokenizer_from=embedded_model_dir)
        for family in FAMILIES
    }


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    path = SHARED_DATA / "gsm8k"
    if not path.is_dir():
        pytest.skip(f"{path} not present")
    return path
