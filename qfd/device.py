"""Device and dtype are decided once, at the CLI boundary, and passed down."""

from __future__ import annotations

from qfd.errors import QfdError

DTYPES = ("auto", "float32", "bfloat16", "float16")


def pick_device(name: str = "auto") -> "torch.device":  # noqa: F821
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise QfdError(f"--device {name} asked for, but no CUDA GPU is visible; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise QfdError(f"unknown device '{name}'; use auto, cpu, cuda or cuda:N") from None


def pick_dtype(name: str, device: "torch.device") -> "torch.dtype":  # noqa: F821
    """auto: bf16 on CUDA, fp32 on CPU (CPU bf16 matmuls are slow and tests need fp32)."""
    import torch

    if name not in DTYPES:
        raise QfdError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
