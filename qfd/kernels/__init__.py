"""GPU kernels (optional: Triton). `qfd.kernels.int4_triton.available()` says whether they run here.

Triton is optional: CUDA torch ships it, the CPU wheel (CI) does not. Each kernel module has
a torch op whose fallback computes the same result in float32 torch where a kernel cannot run.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
    HAVE_TRITON = False


def interpreting() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1): kernels run on CPU tensors, for tests."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(x) -> bool:
    """True when a Triton kernel can take the tensor `x`: Triton, and a CUDA tensor or the interpreter."""
    return HAVE_TRITON and (x.is_cuda or interpreting())
