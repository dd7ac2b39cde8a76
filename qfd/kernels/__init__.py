"""GPU kernels (optional: Triton). `qfd.kernels.int4_triton.available()` says whether they run here.

Triton is optional: CUDA torch ships it, the CPU wheel (CI) does not. Each kernel module has
a torch op whose fallback computes the same result in float32 torch where a kernel cannot run.
"""

from __future__ import annotations

import contextlib
import os
import warnings

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


_graphed_depth = 0  # > 0 inside `graphed_step`


@contextlib.contextmanager
def graphed_step():
    """A step being warmed up and captured as a CUDA graph (`qfd.models.graphs.capture` enters
    it): where the small elementwise kernels (norm_triton, attention_inputs_triton) run, since a replay pays
    no Python launch cost and the eager paths stay as torch runs them."""
    global _graphed_depth
    _graphed_depth += 1
    try:
        yield
    finally:
        _graphed_depth -= 1


def in_graphed_step() -> bool:
    return _graphed_depth > 0


# Kernels first timed on one GPU / Triton version may not compile on another. Those that are
# not yet measured on a GPU launch through `launch_or_fallback`: a failed compile or launch
# warns once and that kernel's op uses its torch fallback from then on (slower, same results).
_FAILED: set[str] = set()


def kernel_failures() -> frozenset[str]:
    """The kernels that have failed here and run their torch fallbacks since."""
    return frozenset(_FAILED)


def launch_or_fallback(name: str, launch, fallback):
    """`launch()`, or `fallback()` once kernel `name` has failed (warned once, at the failure).
    Compilation errors raise before the launch touches any output, so the fallback starts clean."""
    if name not in _FAILED:
        try:
            return launch()
        except Exception as exc:  # triton's CompilationError / OutOfResources, or a driver error at launch
            _FAILED.add(name)
            warnings.warn(f"qfd: Triton kernel {name} failed on this GPU ({type(exc).__name__}: {str(exc)[:160]}); using its torch fallback", RuntimeWarning, stacklevel=2)
    return fallback()
