"""A long prompt's Gated DeltaNet through flash-linear-attention's chunked kernels, where installed.

qfd's own long-prompt path (`qfd.models.gdn.chunked_gated_delta`) builds each chunk's WY form
with batched torch ops (a cuBLAS triangular solve, masks, exponentials) and walks the chunks
in one Triton kernel: at Qwen3.5-4B shape an 8K prompt still launches thousands of small
kernels. flash-linear-attention (`pip install flash-linear-attention`, Triton, GPU only; the
kernels vLLM and transformers use for Qwen3-Next / Qwen3.5) does the same math in ~6 fused
launches per layer. It is optional: qfd uses it for prompts longer than a verify step when it
imports and the tensors are on a GPU (`QFD_GDN_PREFILL=qfd` turns it off, `=fla` insists).

With the package, its causal conv runs too (`prompt_conv_and_rule`): it reads the fused
projection's channels in place (no transposed window copy, no cuDNN depthwise conv) and its
chunk rule normalises q/k and maps each key head to its value heads in-kernel (no float32 q/k
copies, no repeat). An 8K prefill at Qwen3.5-4B shape on an H100: 254 -> 189 ms bf16
(docs/benchmarks.md, 2026-12-06). `QFD_GDN_PROMPT_CONV=torch` keeps qfd's conv and gates
before the package's chunk rule.

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
PROMPT_CONV = os.environ.get("QFD_GDN_PROMPT_CONV", "fla")  # fla (prompt_conv_and_rule) | torch


@functools.cache
def _chunk_rule():
    """flash-linear-attention's `chunk_gated_delta_rule`, or None where it does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no GPU Triton here
        return None
    return chunk_gated_delta_rule


@functools.cache
def _causal_conv():
    """flash-linear-attention's `causal_conv1d`, or None where it does not import."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:
        return None
    return causal_conv1d


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


def takes_prompt(prompt: torch.Tensor, max_verify: int) -> bool:
    """Whether a forward of `prompt` [B, T, C] (more tokens than a verify step) runs its conv
    and chunk rule through the package (`prompt_conv_and_rule`)."""
    return PROMPT_CONV == "fla" and prompt.shape[1] > max_verify and takes(prompt) and _causal_conv() is not None


def prompt_conv_and_rule(tokens, skip, conv_weight, g, beta, state, dims):
    """A prompt's Gated DeltaNet from its raw projections. tokens [B, skip + T, C]: the q/k/v
    channels (any strides), the first `skip` of them conv history only (a cache's conv state;
    their outputs are dropped); conv_weight [C, 1, K]; g [B, T, H] float32 log decays, beta
    [B, T, H]; state [B, H, dk, dv] float32 (not modified); dims (k heads, dk, v heads, dv).
    Returns (out [B, T, H, dv], final state float32)."""
    k_heads, dk, v_heads, dv = dims
    B, C = tokens.shape[0], tokens.shape[-1]
    T = tokens.shape[1] - skip
    conv, _ = _causal_conv()(tokens, conv_weight.reshape(C, -1), activation="silu")
    q, k, v = torch.split(conv[:, skip:], [k_heads * dk, k_heads * dk, v_heads * dv], dim=-1)
    out, final = _chunk_rule()(
        q.reshape(B, T, k_heads, dk), k.reshape(B, T, k_heads, dk), v.reshape(B, T, v_heads, dv), g.float(), beta.to(tokens.dtype),
        scale=dk**-0.5, initial_state=state.float().contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out, final.float()
