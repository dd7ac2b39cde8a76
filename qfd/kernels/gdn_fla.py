"""A long prompt's Gated DeltaNet through flash-linear-attention's chunked kernels, where installed.

qfd's own long-prompt path (`qfd.models.gdn.chunked_gated_delta`) builds each chunk's WY form
with batched torch ops (a cuBLAS triangular solve, masks, exponentials) and walks the chunks
in one Triton kernel: at Qwen3.5-4B shape an 8K prompt still launches thousands of small
kernels. flash-linear-attention (`pip install flash-linear-attention`, Triton, GPU only; the
kernels vLLM and transformers use for Qwen3-Next / Qwen3.5) does the same math in ~6 fused
launches per layer. It is optional: qfd uses it for prompts longer than a verify step when it
imports and the tensors are on a GPU (`QFD_GDN_PREFILL=qfd` turns it off, `=fla` insists).

Precision: q, k and v go in at the model's 16-bit dtype (as transformers passes them), the
decays and the state in float32; qfd's own path is float32 throughout. Losslessness does not
depend on it: the prompt's state is whatever the target computed, and every later token is
the target's own choice in its verify pass.
"""

from __future__ import annotations

import functools
import os

import torch

BACKEND = os.environ.get("QFD_GDN_PREFILL", "auto")  # auto | fla | qfd


@functools.cache
def _chunk_rule():
    """flash-linear-attention's `chunk_gated_delta_rule`, or None where it does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no GPU Triton here
        return None
    return chunk_gated_delta_rule


def installed() -> bool:
    """flash-linear-attention's chunked kernel imports here."""
    return _chunk_rule() is not None


def takes(q: torch.Tensor) -> bool:
    """Whether the long-prompt recurrence of `q`'s forward runs here: a CUDA tensor, no autograd
    (the QAD teacher/student and drafter training keep qfd's float32 path), and the package."""
    if BACKEND == "qfd" or not q.is_cuda or torch.is_grad_enabled():
        return False
    if not installed():
        if BACKEND == "fla":
            raise RuntimeError("QFD_GDN_PREFILL=fla but flash-linear-attention does not import here")
        return False
    return True


def chunked_gated_delta(q, k, v, g, beta, state):
    """`qfd.models.gdn.chunked_gated_delta`'s arguments and results (q, k prepared: normalised,
    q scaled; [B, T, H, d]; state [B, H, dk, dv] float32, not modified) through the package.
    Returns (out [B, T, H, dv] float32, final state [B, H, dk, dv] float32)."""
    dtype = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    out, final = _chunk_rule()(
        q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.to(dtype),
        scale=1.0,  # prepare_qk already scaled q
        initial_state=state.float().contiguous(), output_final_state=True,
    )
    return out.float(), final.float()
