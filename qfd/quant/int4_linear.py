"""Int4Linear: a linear layer that executes an INT4 QuantizedWeight directly.

Kernels (torch built-ins, tinygemm convention w = (u - 8) * scale + zero with u in 0..15 and
a per-group FLOAT zero): on CPU `_weight_int4pack_mm_for_cpu`, on CUDA `_weight_int4pack_mm`
(bf16 activations). Our grid w = (q - z) * s maps to it exactly in real arithmetic:
u = q (zero-point codes) or q + 8 (symmetric), zero = (8 - z) * s; in floating point the
result differs from the dequantized matmul only by rounding (see
tests/test_quant_int4_linear.py). The kernels win for decode-sized inputs only, so inputs of
more than KERNEL_MAX_ROWS rows dequantize the weight on the fly from the kept nibbles and run a
dense matmul. Shapes or devices a kernel rejects use a stored dequantized weight
(`mode == "dequant"`), and so do float32 layers on the CPU: with torch 2.13 the CPU kernel is
fast only for bf16 activations (2-core box, M=1: 576x576 15 us vs 27 us dense bf16; with fp32
activations 284 us vs 23 us dense fp32, 12x SLOWER; docs/benchmarks.md, fifth session). A
float32 CPU model therefore keeps the dequantized weights: the speed and memory of the bf16
source model, exact w_hat arithmetic.

On CUDA a second kernel is available: qfd's own Triton W4A16 matmul
(`qfd.kernels.int4_triton`, mode "triton"), fast at 1 and at 16 rows where tinygemm
is 2x slower than bf16 at 16 (environment.md). `kernel=` (or $QFD_INT4_KERNEL) picks
"tinygemm" or "triton"; the default is DEFAULT_CUDA_KERNEL, set from bench/bench_int4_kernels.py
on the H200 (docs/benchmarks.md). Triton missing, or a shape it rejects: tinygemm.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from qfd.models.linear import linear as dense_linear
from qfd.quant.grid import dequantize
from qfd.quant.types import QuantizedWeight

# Rows up to which the INT4 kernel beats dequantize-then-matmul: on CPU measured at 8 (see the
# module docstring); on CUDA a 16-row verify block through tinygemm (~30 us at 9216x2560)
# beats re-dequantizing the weight every call (H200, docs/benchmarks.md). The Triton kernel
# tiles rows by 16 (6-19 us per 16-row tile at Qwen3.5-4B shapes) while dequantizing a weight
# per call cost ~1 ms per linear in torch (a 64-token INT4 prefill took 272 ms vs 47 ms in
# bf16): it takes prompts up to 256 rows (not yet timed at 64-256 rows). Longer ones
# dequantize with qfd's Triton dequant kernel (`qfd.kernels.int4_dequant`, one pass over the
# codes, not yet timed on a GPU either: bench/bench_int4_dequant.py) and run cuBLAS.
KERNEL_MAX_ROWS = {"cpu_int4": 8, "cuda_int4": 16, "triton": 256}
# A gate/up pair (`Int4Linear.gated_pair`) applies its activation in the Triton kernel's store at
# every row count the kernel takes. Measured on the H100 (docs/benchmarks.md, twenty-second
# session; 18432 x 2560, us per call in a CUDA graph), GATED vs the plain product + compiled
# activation: 16.83 vs 18.24 at one row (1.08x), 18.64 vs 19.88 at 16 (1.07x), 21.88 vs 24.52 at
# 32 (1.12x), once the epilogue stored vectors (it was 0.85x at 32 rows with 2-byte stores).
# Elsewhere (tinygemm's one row, the dequant path's long prompts) torch applies it after the
# product, on the interleaved columns.

CUDA_KERNELS = ("tinygemm", "triton")
# Triton: at 16 rows (the verify) 113 us vs tinygemm's 203 us over Qwen3.5-4B's linears, at
# 1 row 78 vs 62 us; the verify dominates a speculative step (H200, docs/benchmarks.md).
DEFAULT_CUDA_KERNEL = "triton"
# One-row products (decode) of a Triton-mode layer through tinygemm instead: torch's kernel
# measured 1.12-1.39x faster than qfd's at one row on the H100 (docs/benchmarks.md, tenth
# session) while qfd's is ~2x faster at 16 rows. QFD_INT4_ONE_ROW=tinygemm keeps the weight in
# both layouts (twice the INT4 body's memory); off by default until a whole step is measured.
ONE_ROW_KERNELS = ("triton", "tinygemm")


def one_row_kernel() -> str:
    """$QFD_INT4_ONE_ROW: which kernel a Triton-mode layer runs one-row products through."""
    choice = os.environ.get("QFD_INT4_ONE_ROW", "triton")
    if choice not in ONE_ROW_KERNELS:
        raise ValueError(f"QFD_INT4_ONE_ROW={choice!r}: expected one of {', '.join(ONE_ROW_KERNELS)}")
    return choice


def cuda_kernel_choice(kernel: str | None = None) -> str:
    """The CUDA INT4 kernel to use: `kernel`, else $QFD_INT4_KERNEL, else DEFAULT_CUDA_KERNEL."""
    import os

    choice = kernel or os.environ.get("QFD_INT4_KERNEL") or DEFAULT_CUDA_KERNEL
    if choice not in CUDA_KERNELS:
        raise ValueError(f"INT4 kernel {choice!r}: expected one of {', '.join(CUDA_KERNELS)} ($QFD_INT4_KERNEL)")
    return choice


def tinygemm_operands(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(u [out, in] int32 in 0..15, scales_and_zeros [in/g, out, 2] fp32) for torch's int4 mm."""
    scales = qw.scales.to(torch.float32)
    if qw.zeros is None:
        u = qw.codes.to(torch.int32) + 8
        zero = torch.zeros_like(scales)
    else:
        u = qw.codes.to(torch.int32) - qw.zeros.to(torch.int32).repeat_interleave(qw.group_size, 1) + 8
        zero = torch.zeros_like(scales)
        if int(u.min()) < 0 or int(u.max()) > 15:  # z outside 0..15 shifted the codes: use the float zero instead
            u = qw.codes.to(torch.int32)
            zero = (8 - qw.zeros.to(torch.float32)) * scales
    return u, torch.stack([scales, zero], dim=-1).transpose(0, 1).contiguous()


def tinygemm_operands_from_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tinygemm_operands` from a Triton-mode layer's buffers (also a fused one, whose parts'
    QuantizedWeights are gone): u = the stored nibbles (0..15) and the float zero for which
    (u - 8) * s + zero = (u - z) * s, i.e. zero = (8 - z) * s (z = 8 when symmetric)."""
    from qfd.kernels.int4_layout import TritonInt4Weight, unpack_codes

    groups = in_features // group_size
    layout = TritonInt4Weight(qweight, scales, zeros, torch.empty(0), group_size, in_features, qweight.shape[1])
    u = unpack_codes(layout)
    s = scales[:groups].t().to(torch.float32)
    z = 8.0 if zeros is None else zeros[:groups].t().to(torch.float32)
    return u, torch.stack([s, (8.0 - z) * s], dim=-1).transpose(0, 1).contiguous()


def pack_tinygemm_cuda(u: torch.Tensor, sz: torch.Tensor, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile-packed weight, scales_and_zeros) for torch's CUDA `_weight_int4pack_mm` (bf16)."""
    u8 = ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8).to(device)
    return torch.ops.aten._convert_weight_to_int4pack(u8, 8), sz.to(device=device, dtype=dtype)


class Int4Linear(nn.Module):
    """y = x @ w_hat.T + b with w_hat = (q - z) * s kept as INT4.

    Buffers: `packed` (kernel layout for the device it was built on), `scales_and_zeros`
    [in/g, out, 2]; `mode` is "cpu_int4", "cuda_int4" (tinygemm), "triton" (then the
    Triton layout's `triton_*` buffers) or "dequant" (then `weight_dense`)."""

    def __init__(self, qw: QuantizedWeight, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, allow_kernel: bool = True, kernel: str | None = None):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        self.dtype = dtype
        device = torch.device(device)
        self.mode = "dequant"
        bias = qw.bias.to(device=device, dtype=dtype) if qw.bias is not None else None
        self.register_buffer("bias", bias)
        # Triton on CUDA when chosen; anywhere when asked for by name (on a CPU the op runs its
        # float32 reference: how the tests check the layout and the op without a GPU)
        if allow_kernel and (kernel == "triton" or (device.type == "cuda" and cuda_kernel_choice(kernel) == "triton")):
            self._try_triton(qw, device, dtype)
        if allow_kernel and self.mode == "dequant":
            self._try_kernel(qw, device, dtype)
        if self.mode == "dequant":
            self.register_buffer("weight_dense", dequantize(qw, dtype).to(device))

    def _try_kernel(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> None:
        u, sz = tinygemm_operands(qw)
        try:
            if device.type == "cpu":
                if dtype != torch.bfloat16:
                    return  # the CPU kernel is 12x slower than a dense matmul for fp32 activations (module docstring)
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)
                sz = sz.to(dtype)
                probe = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, self.in_features, dtype=dtype), packed, self.group_size, sz)
                mode = "cpu_int4"
            elif device.type == "cuda" and dtype == torch.bfloat16:
                packed, sz = pack_tinygemm_cuda(u, sz, device, dtype)
                probe = torch.ops.aten._weight_int4pack_mm(torch.zeros(1, self.in_features, dtype=dtype, device=device), packed, self.group_size, sz)
                mode = "cuda_int4"
            else:
                return
        except (RuntimeError, NotImplementedError):
            return  # shape/dtype the kernel does not take: dequantized fallback
        if probe.shape[-1] != self.out_features:
            return
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        # nibbles (u of columns 2i, 2i+1 in one byte) for the on-the-fly dequantized path
        self.register_buffer("nibbles", ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8).to(device))
        self.mode = mode

    def _try_triton(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> None:
        from qfd.kernels import int4_layout, int4_triton

        if device.type == "cuda" and not int4_triton.available():
            return
        try:
            packed = int4_layout.pack_for_triton(qw, device, scale_dtype=dtype)
        except ValueError:
            return  # a group size / code range the layout does not take: tinygemm or dequant
        for name in ("qweight", "scales", "zeros", "counters"):
            self.register_buffer(f"triton_{name}", getattr(packed, name))
        self.mode = "triton"
        self._no_one_row_layout()
        if device.type == "cuda" and one_row_kernel() == "tinygemm":
            self._add_one_row_tinygemm()

    def _no_one_row_layout(self) -> None:
        for name in ("one_row_packed", "one_row_scales_and_zeros"):  # not in the state dict: derived
            self.register_buffer(name, None, persistent=False)

    def _add_one_row_tinygemm(self) -> None:
        """The same weight in tinygemm's layout too, for one-row products (QFD_INT4_ONE_ROW);
        left out (Triton for every product) where tinygemm rejects the shape or dtype."""
        if self.dtype != torch.bfloat16:
            return
        u, sz = tinygemm_operands_from_triton(self.triton_qweight, self.triton_scales, self.triton_zeros, self.group_size, self.in_features)
        try:
            packed, sz = pack_tinygemm_cuda(u, sz, self.triton_qweight.device, self.dtype)
        except (RuntimeError, NotImplementedError):
            return
        self.register_buffer("one_row_packed", packed, persistent=False)
        self.register_buffer("one_row_scales_and_zeros", sz, persistent=False)

    # The next product's packed weights, asked of the L2 while this one runs (`link_prefetches`;
    # a plain attribute, not a buffer: it belongs to another module)
    prefetch_next: torch.Tensor | None = None
    # A gate/up pair (`gated_pair`): outputs interleave gate and up, the forward returns
    # silu(gate) * up [..., out_features / 2]
    gated: bool = False

    def _triton_matmul(self, x2: torch.Tensor, gated: bool = False) -> torch.Tensor:
        from qfd.kernels.int4_triton import int4_mm_op

        return int4_mm_op(x2, self.triton_qweight, self.triton_scales, self.triton_zeros, self.triton_counters, self.bias, self.group_size, self.in_features,
                          self.prefetch_next, gated)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """w = (u - 8) * scale + zero, [out, in], from the kept nibbles (same formula as the kernel)."""
        if self.mode == "dequant":
            return self.weight_dense.to(dtype)
        if self.mode == "triton":  # qfd's dequant kernel writes w_hat.T [in, out] (coalesced); a view back
            from qfd.kernels.int4_dequant import int4_dequant_op

            return int4_dequant_op(self.triton_qweight, self.triton_scales, self.triton_zeros, self.group_size, self.in_features, dtype).t()
        u = torch.stack([self.nibbles >> 4, self.nibbles & 0xF], dim=-1).reshape(self.out_features, self.in_features)
        sz = self.scales_and_zeros.to(torch.float32)
        scale = sz[..., 0].t().repeat_interleave(self.group_size, 1)
        zero = sz[..., 1].t().repeat_interleave(self.group_size, 1)
        return ((u.to(torch.float32) - 8) * scale + zero).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "dequant":  # qfd's Linear math: its CPU few-row path included
            return dense_linear(x, self.weight_dense.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        one_row_tinygemm = self.mode == "triton" and x2.shape[0] == 1 and getattr(self, "one_row_packed", None) is not None
        if self.mode == "triton" and not one_row_tinygemm and x2.shape[0] <= KERNEL_MAX_ROWS["triton"]:
            y = self._triton_matmul(x2, gated=self.gated)
        else:
            y = self._other_matmul(x2, one_row_tinygemm)
            if self.gated:
                from qfd.kernels.int4_layout import silu_mul_interleaved

                y = silu_mul_interleaved(y)
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)

    def _other_matmul(self, x2: torch.Tensor, one_row_tinygemm: bool) -> torch.Tensor:
        """x2 [M, in] @ w.T (+ bias) [M, out] outside the Triton kernel: the kernels' row limit
        passed, tinygemm or the CPU kernel."""
        if x2.shape[0] > KERNEL_MAX_ROWS[self.mode]:
            # Triton mode: the dequant kernel's w_t [in, out] transposed back, a free view
            # (F.linear over it is the same cuBLAS call as x @ w_t)
            return nn.functional.linear(x2, self.dequantized_weight(self.dtype), self.bias)
        if self.mode == "cpu_int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        elif one_row_tinygemm:  # QFD_INT4_ONE_ROW=tinygemm: the second layout
            y = torch.ops.aten._weight_int4pack_mm(x2, self.one_row_packed, self.group_size, self.one_row_scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias

    @classmethod
    def gated_pair(cls, gate: "Int4Linear", up: "Int4Linear") -> "Int4Linear | None":
        """One Triton-mode Int4Linear for an MLP's gate and up projections whose forward returns
        silu(gate) * up: the pair's buffers interleaved column by column
        (`int4_layout.interleave_columns`), so the product's kernel can apply the activation as it
        stores each tile - no activation kernel, no [.., 2 x intermediate] round trip through
        memory - wherever the Triton kernel runs the product. None where they cannot
        pair (another mode, sizes, or what `concatenated` refuses)."""
        if gate.mode != "triton" or up.mode != "triton" or gate.out_features != up.out_features:
            return None
        from qfd.kernels.int4_layout import interleave_columns

        fused = cls.concatenated([gate, up], join=interleave_columns)
        if fused is not None:
            fused.gated = True
        return fused

    @classmethod
    def concatenated(cls, parts: "list[Int4Linear]", join=None) -> "Int4Linear | None":
        """One Int4Linear computing the `parts`' outputs side by side (in order), for layers
        that read the same input (qfd.models.fuse); None when they cannot share one: another
        in_features / group size / dtype / device / mode, bias on some only, or a tinygemm
        mode (its tile-packed `packed` buffer cannot be cut along the outputs). "dequant"
        stacks `weight_dense` [out, in] along dim 0; "triton" its buffers along N, dim 1
        (column n of each belongs to output n, see `pack_for_triton`): both exact. `join`: how the
        buffers combine along the outputs, torch.cat by default (`gated_pair` interleaves)."""
        first = parts[0]
        if first.mode not in ("dequant", "triton") or any((p.mode, p.in_features, p.group_size, p.dtype) != (first.mode, first.in_features, first.group_size, first.dtype) for p in parts):
            return None
        dims = {"bias": 0, "weight_dense": 0} if first.mode == "dequant" else {"bias": 0, "triton_qweight": 1, "triton_scales": 1, "triton_zeros": 1}
        buffers = {}
        for name, dim in dims.items():
            values = [getattr(p, name) for p in parts]
            if all(v is None for v in values):
                buffers[name] = None
                continue
            if any(v is None for v in values):
                return None  # bias on some parts only, or symmetric and zero-point parts
            kept = [(v.dtype, v.device, v.shape[:dim] + v.shape[dim + 1 :]) for v in values]
            if kept.count(kept[0]) != len(kept):
                return None
            buffers[name] = torch.cat(values, dim) if join is None else join(*values)
        fused = cls.__new__(cls)  # no __init__: the parts are already quantized and packed
        nn.Module.__init__(fused)
        fused.out_features = sum(p.out_features for p in parts)
        fused.in_features, fused.group_size, fused.dtype, fused.mode = first.in_features, first.group_size, first.dtype, first.mode
        for name, value in buffers.items():
            fused.register_buffer(name, value)
        if first.mode == "triton":
            # split-K tile counters count programs of one launch, not outputs: a fresh zeroed set
            fused.register_buffer("triton_counters", torch.zeros_like(first.triton_counters))
            fused._no_one_row_layout()
            if getattr(first, "one_row_packed", None) is not None:  # the parts' layouts cannot be cut apart: rebuilt
                fused._add_one_row_tinygemm()
        probe = getattr(first, "weight", None)  # the loaders' dtype probe (int4_load.give_dtype_probe)
        if isinstance(probe, torch.Tensor):
            fused.register_buffer("weight", torch.empty(0, device=probe.device, dtype=probe.dtype), persistent=False)
        return fused.train(first.training)

    def extra_repr(self) -> str:
        gated = ", gated (returns silu(gate) * up)" if self.gated else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, mode={self.mode}{gated}"


def swap_int4_linears(model: nn.Module, qweights: dict[str, QuantizedWeight], allow_kernel: bool = True, kernel: str | None = None) -> nn.Module:
    """Replace, in place, every nn.Linear named in `qweights` (module paths as in
    `model.named_modules()`) by an Int4Linear on that linear's device and dtype. A bias stored
    with the QuantizedWeight wins over the module's own. `kernel`: the CUDA kernel
    (`cuda_kernel_choice`). Returns `model`."""
    modules = dict(model.named_modules())
    missing = [path for path in qweights if path not in modules]
    if missing:
        raise KeyError(f"swap_int4_linears: no module named {missing[:3]}")
    for path, qw in qweights.items():
        old = modules[path]
        weight = getattr(old, "weight", None)
        device = weight.device if weight is not None else torch.device("cpu")
        dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
        if qw.bias is None and getattr(old, "bias", None) is not None:
            qw = QuantizedWeight(qw.codes, qw.scales, qw.zeros, qw.group_size, qw.bits, old.bias.detach())
        new = Int4Linear(qw, device=device, dtype=dtype, allow_kernel=allow_kernel, kernel=kernel)
        parent_path, _, name = path.rpartition(".")
        setattr(modules[parent_path] if parent_path else model, name, new)
    return model


# QFD_INT4_PREFETCH=1: each INT4 product's programs ask the L2 for the next product's packed
# weights as they start (`link_prefetches`). At batch 1 a product streams its weights at about a
# third of HBM bandwidth and the small kernels between two products leave HBM idle; the next
# product then reads from L2 what was fetched meanwhile. A hint: results do not change. Measured
# no gain (H200, graphed short-setting steps, docs/benchmarks.md eighteenth session: INT4 decode
# 5.255 -> 5.502 ms, verify 7.054 -> 7.125, near that run's noise): off; kept for other GPUs
# (bench/gpu_kernels_ab.sh VARIANTS="fused int4_prefetch").
PREFETCH_NEXT = os.environ.get("QFD_INT4_PREFETCH", "0") == "1"


def link_prefetches(model: nn.Module, step: Callable[[], object]) -> int:
    """Run `step()` (one forward of `model`) once, recording the order in which it calls its
    Triton-layout Int4Linears, and give each the next one's packed weights to prefetch (the last
    one none). Returns the number of links. Call it before torch.compile or CUDA-graph capture:
    the attribute is read when the forward is traced."""
    order: list[Int4Linear] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: order.append(mod)) for m in model.modules()
             if isinstance(m, Int4Linear) and m.mode == "triton"]
    try:
        with torch.inference_mode():
            step()
    finally:
        for hook in hooks:
            hook.remove()
    for module, following in zip(order, order[1:]):
        module.prefetch_next = following.triton_qweight
    if order:
        order[-1].prefetch_next = None
    return max(0, len(order) - 1)
