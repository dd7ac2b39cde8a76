"""RMSNorm in one Triton launch, for the CUDA-graphed steps that torch.compile does not fuse.

Uncompiled (the Engine's default: `--compile` is opt-in), torch runs an RMSNorm as about eight
kernels - a float copy, pow, mean, add, rsqrt, mul, a cast, the weight's mul - and the Gated
DeltaNet's gated norm four more. The Qwen3.5-4B shape has 105 norms a step: with this kernel a
graphed INT4 decode ran 534 launches instead of 1551, 3.31 ms instead of 5.83 (H100,
docs/benchmarks.md, twenty-second session). `use_kernel` keeps torch's form
- under torch.compile: inductor fuses it with its neighbours (the residual add, the cast), which
  this opaque kernel would prevent;
- outside a graphed step (`qfd.kernels.graphed_step`: graphs.capture's warm-up and capture): the
  same run's eager 64-token prefill was slower with the kernel (164 vs 126 ms INT4, 121 vs 62 ms
  bf16; not explained - the eager prefill ran first and is CPU-bound, and it varied 69-126 ms
  between machines without the kernel), so eager paths stay as they were until measured apart
  (`QFD_FUSED_NORM=all` runs the kernel there too, for that A/B).

One program normalises one row of D values (D <= 4096: a hidden state, a head) with the same
rounding points as the modules' torch code (qfd.models.target.RMSNorm, which the drafter uses too,
and qfd.models.gdn.GatedRMSNorm):
- PLAIN: w * round(h), h = x * rsqrt(mean(x^2) + eps) in float32;
- ZERO_CENTERED (Qwen3.5): round(h * (1 + w));
- GATED: round(round(w * round(h)) * silu(z)), x first rounded to z's dtype (the GDN core
  output arrives in float32 and the torch form casts it before the norm).
Rows may be strided two levels deep ([rows, heads, D] views of a projection's output), so a
split or sliced input needs no copy.
"""

from __future__ import annotations

import os

import torch

from qfd.kernels import HAVE_TRITON, in_graphed_step, launch_or_fallback, tl, triton  # noqa: F401 (tl: the kernel)

PLAIN, ZERO_CENTERED, GATED = 0, 1, 2
MAX_DIM = 4096

if HAVE_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, z_ptr, y_ptr, D, HEADS, sx_r, sx_h, sz_r, sz_h, eps,
                         BD: tl.constexpr, MODE: tl.constexpr, ROUND_X: tl.constexpr, ADD: tl.constexpr = False, a_ptr=None, s_ptr=None):
        """Row `program_id(0)` of y [rows * HEADS, D] (contiguous) from x and z [rows, HEADS, D]
        (strides sx_r, sx_h; 1 along D). ADD: x is first the rounded sum x + a (a contiguous [rows
        * HEADS, D], stored to s as well): a residual add and the norm after it in one launch."""
        pid = tl.program_id(0)
        r = pid // HEADS
        hd = pid % HEADS
        offs = tl.arange(0, BD)
        mask = offs < D
        y_dtype = y_ptr.dtype.element_ty
        x = tl.load(x_ptr + r * sx_r + hd * sx_h + offs, mask=mask, other=0.0)
        if ADD:  # as torch's h + x: float32 sum, rounded to the dtype
            x = (x.to(tl.float32) + tl.load(a_ptr + pid * D + offs, mask=mask, other=0.0).to(tl.float32)).to(y_dtype)
            tl.store(s_ptr + pid * D + offs, x, mask=mask)
        if ROUND_X:  # the torch form's cast of the input to the output's dtype, before the norm
            x = x.to(y_dtype)
        x = x.to(tl.float32)
        h = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 1:
            y = h * (1.0 + w)
        else:
            y = w * h.to(y_dtype).to(tl.float32)
            if MODE == 2:
                z = tl.load(z_ptr + r * sz_r + hd * sz_h + offs, mask=mask, other=0.0).to(tl.float32)
                y = y.to(y_dtype).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
        tl.store(y_ptr + pid * D + offs, y.to(y_dtype), mask=mask)


def setting() -> str:
    """QFD_FUSED_NORM: "1" (default) the kernel in graphed steps, "0" torch's RMSNorm everywhere,
    "all" the kernel in eager CUDA forwards too (read at each call: the A/B bench switches it)."""
    value = os.environ.get("QFD_FUSED_NORM", "1")
    return value if value in ("0", "all") else "1"


def add_enabled() -> bool:
    """A decoder layer's two residual adds join the norms after them (`add_rms_norm`: 65 launches
    less a Qwen3.5-4B step). On by default: graphed uncompiled INT4 decode 2.878 vs 2.992 ms with it
    alone, 2.569 with QFD_FUSED_QKV too (H100, docs/benchmarks.md, twenty-third session);
    QFD_FUSED_ADD_NORM=0 turns it off."""
    return os.environ.get("QFD_FUSED_ADD_NORM", "1") != "0"


def use_kernel(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether a module's norm of x runs `rms_norm`: not under torch.compile's tracing (checked
    first, so the trace reads nothing else), inside `qfd.kernels.graphed_step`, a CUDA tensor, a weight
    already in the output's dtype (else torch's type promotion would give a float32 result the
    kernel does not reproduce), D within MAX_DIM (module docstring)."""
    if torch.compiler.is_compiling():
        return False
    where = setting()
    return ((where == "all" or (where == "1" and in_graphed_step())) and HAVE_TRITON and x.is_cuda and weight.dtype == out_dtype
            and x.shape[-1] <= MAX_DIM)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = PLAIN, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The norm modules' forward (target, drafter, Gated DeltaNet): the kernel where `use_kernel`
    says, else torch's form (`reference`), which torch.compile fuses."""
    if use_kernel(x, weight, gate.dtype if mode == GATED else x.dtype):
        return rms_norm(x, weight, eps, mode, gate)
    return reference(x, weight, eps, mode, gate)


def add_and_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + x, its norm): a residual add and the norm after it, in one launch (`add_rms_norm`)
    where the norm would run its kernel (unless QFD_FUSED_ADD_NORM=0), else as two steps."""
    if add_enabled() and h.dtype == x.dtype and use_kernel(h, weight, h.dtype):
        return add_rms_norm(h, x, weight, eps, mode)
    total = h + x
    return total, norm(total, weight, eps, mode)


def _meta(d: int) -> dict:
    """Launch parameters for rows of d values: one power-of-two block, 8 warps past 1024."""
    return dict(BD=triton.next_power_of_2(d), num_warps=4 if d <= 1024 else 8)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as [rows, heads, D] with unit stride along D (a view where one exists)."""
    t3 = t.reshape(-1, t.shape[-2] if t.dim() >= 3 else 1, t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = PLAIN, gate: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The norm of x [..., D] over D in one launch (module docstring), y [..., D] in `out_dtype`
    (default x's; GATED: z's). mode: PLAIN, ZERO_CENTERED or GATED (gate z shaped as x)."""
    if mode == GATED:
        if gate is None or gate.shape != x.shape:
            raise ValueError(f"rms_norm: GATED needs a gate shaped as x {tuple(x.shape)}, got {None if gate is None else tuple(gate.shape)}")
        out_dtype = gate.dtype
    out_dtype = out_dtype or x.dtype
    d = x.shape[-1]

    def launch():
        x3 = _rows(x)
        z3 = _rows(gate) if mode == GATED else x3
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        grid = (x3.shape[0] * x3.shape[1],)
        _rms_norm_kernel[grid](x3, weight, z3, y, d, x3.shape[1], x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), eps,
                               MODE=mode, ROUND_X=x.dtype != out_dtype, **_meta(d))
        return y

    return launch_or_fallback("rms_norm", launch, lambda: reference(x, weight, eps, mode, gate, out_dtype))


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + x, its norm) in one launch for same-shaped, same-dtype h and x [..., D]; mode PLAIN
    or ZERO_CENTERED."""
    if h.shape != x.shape or h.dtype != x.dtype or mode == GATED:
        raise ValueError(f"add_rms_norm: needs two {tuple(h.shape)} {h.dtype} inputs and a plain or zero-centered norm")
    d = h.shape[-1]

    def launch():
        h2, x2 = h.reshape(-1, d).contiguous(), x.reshape(-1, d).contiguous()
        total, y = torch.empty_like(h2), torch.empty_like(h2)
        _rms_norm_kernel[(h2.shape[0],)](h2, weight, h2, y, d, 1, d, d, d, d, eps, MODE=mode, ROUND_X=False, ADD=True, a_ptr=x2, s_ptr=total, **_meta(d))
        return total.reshape(h.shape), y.reshape(h.shape)

    def fallback():
        total = h + x
        return total, reference(total, weight, eps, mode)

    return launch_or_fallback("add_rms_norm", launch, fallback)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = PLAIN, gate: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The modules' torch form (what they ran before the kernel), with its rounding points."""
    dtype = gate.dtype if mode == GATED else (out_dtype or x.dtype)
    h = x.to(dtype).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if mode == ZERO_CENTERED:
        return (h * (1.0 + weight.float())).to(dtype)
    y = weight * h.to(dtype)
    if mode == GATED:
        return (y * torch.nn.functional.silu(gate.float())).to(dtype)
    return y
