"""Attention of a decode / verify / tree step over a KV cache in Triton: split-KV
("flash-decoding"), grouped-query without copying K/V.

The torch path (`qfd.models.target.grouped_attention`) runs a step's attention as a scores
GEMM, a masked float32 softmax, a values GEMM split by hand over 512-key chunks and a sum: at
Qwen3.5-4B shape and an 8.5K static cache the H100 spends ~270 us of a compiled INT4 decode
and ~360 us of a 16-token verify in those kernels over the 8 attention layers
(docs/benchmarks.md, tenth session), where reading K and V once takes ~95 us. Here one kernel
reads each K/V tile once for all query rows of its kv head (the group's query heads x the
step's tokens) with an online softmax, over SPLITS slices of the keys in parallel; a second
kernel merges the slices' partial results (their max, sum and weighted values). Given the
step's key count (its last slot + 1), both kernels work on the filled keys only, spread over the
splits at run time: a short context in a long static cache (the server's, or the benchmarks'
8.5K) reads its few hundred keys, not the whole buffer under the mask: on the H200 a decode /
16-token verify at 200 filled keys of 8704 took 6.0 / 11.7 us a layer against 18.5 / 24.9
(`bench/bench_attention.py --filled`, docs/benchmarks.md eighteenth session). The block loops'
bounds are then rounded up to whole key blocks (see `_live_keys`): before that rounding a full
cache's verify ran 0.73x, with it 1.01x (H100, nineteenth session).

On the H100 (docs/benchmarks.md, twelfth session) one layer's step attention at an 8.5K cache
takes 19.8 / 28.6 / 36.8 us for a decode / 16-token verify / 32-node tree against the torch
path's 52.0 / 76.7 / 107.5 us, and a graphed step's kernel time drops by 5.6-6.8%. The default
on CUDA; `QFD_ATTENTION_KERNEL=torch` keeps the torch path. Where the kernels fail to compile
(another GPU's limits) the step warns once and uses the torch path from then on.
"""

from __future__ import annotations

import functools
import os

import torch

from qfd import kernels
from qfd.errors import QfdError
from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, launch_or_fallback, runs_on, tl, triton  # noqa: F401 (tl: the kernel)

SPLIT_KERNEL = os.environ.get("QFD_ATTENTION_KERNEL", "triton") == "triton"
_MAX_ROWS = 64  # query rows per program (more rows: several programs read the same keys)
_MAX_SPLITS = 64  # the merge loads every split's partial of a row at once


def parse_configs(text: str) -> dict[int, tuple[int, int, int]]:
    """QFD_ATTENTION_CONFIG, e.g. "16=32,4,2;64=32,8,1": rows per program -> (keys per loop
    step, warps, pipeline stages) of the split kernel (bench/bench_attention.py prints the
    fastest per step kind)."""
    configs = {}
    try:
        for item in filter(None, text.replace(" ", "").split(";")):
            rows, values = item.split("=")
            block_keys, warps, stages = (int(v) for v in values.split(","))
            configs[int(rows)] = (block_keys, warps, stages)
    except ValueError:
        raise QfdError(f"QFD_ATTENTION_CONFIG={text!r}: expected rows=keys,warps,stages entries separated by ';', e.g. 16=32,4,2;64=32,4,2") from None
    return configs


CONFIGS: dict[int, tuple[int, int, int]] = {}  # set by bench/bench_attention.py; then the environment's


@functools.cache
def _environment_configs() -> dict[int, tuple[int, int, int]]:
    return parse_configs(os.environ.get("QFD_ATTENTION_CONFIG", ""))  # read at the first step, not at import


def split_config(head_dim: int, block_rows: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int]:
    """(keys per loop step, warps, stages) for the split kernel: CONFIGS' or QFD_ATTENTION_CONFIG's
    entry, else 32 keys, 4 warps, 2 stages for 256-wide heads - the fastest of 8 configs at every
    Qwen3.5-4B step but one (bench/bench_attention.py on the H100, docs/benchmarks.md twelfth
    session) - and 64 keys for narrower heads (not measured). float32 256-wide heads at 64 rows a
    block take 136 KB of shared memory per block that way, more than an A10G / L4 (sm_86 / 89)
    has (99 KB): 16 keys and one stage take 84 KB there (bf16: 68 KB; bench/compile_kernels.py)."""
    for table in (CONFIGS, _environment_configs()):
        if block_rows in table:
            return table[block_rows]
    if dtype == torch.float32 and head_dim > 128:
        return 16, 4, 1
    return (32 if head_dim > 128 else 64), 4, 2


def takes(q: torch.Tensor) -> bool:
    """Whether a step's attention runs through the kernels here (not after they have failed: then
    the step calls the torch path itself, which torch.compile can fuse, rather than the op)."""
    return SPLIT_KERNEL and runs_on(q) and q.shape[-1] in (16, 32, 64, 128, 256) and "split_attention" not in kernels._FAILED


if _HAVE_TRITON:

    @triton.jit
    def _live_keys(count_ptr, S, SPLITS, HAS_COUNT: tl.constexpr, BS: tl.constexpr):
        """(keys that can be visible, that count rounded up to whole BS blocks, keys per split):
        the step's key count where the caller gave one (a static cache's unfilled tail is
        skipped, not read under the mask), else the whole buffer; the live blocks spread over
        the SPLITS splits. The rounded bound keeps the block loops' bounds multiples of 16, which
        the mask loads need to stay vector loads (with the loaded count alone a 16-token verify
        ran 0.73x on a full cache, H200; rounded, 1.01x on an H100); K/V are read up to the exact count only."""
        n = S
        if HAS_COUNT:
            n = tl.minimum(tl.load(count_ptr).to(tl.int32), S)
        blocks = tl.cdiv(n, BS)
        return n, tl.minimum(blocks * BS, S), tl.cdiv(blocks, SPLITS) * BS

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, count_ptr, acc_ptr, ml_ptr,
        T, S, R, KVH, GROUP, SPLITS, scale,
        sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_t,
        D: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr, HAS_COUNT: tl.constexpr,
    ):
        """Program (b * KVH + kv head, row block, split): rows [BR*pid_r, +BR) of the kv head's
        R = GROUP * T query rows (row r: query head kvh * GROUP + r // T, token r % T) against
        its split of the live keys (`_live_keys`). Writes the unnormalised weighted values
        [BR, D] and the running max and sum of each row (float32); a split past the live keys
        writes nothing (the merge skips it)."""
        pid_bh = tl.program_id(0)
        b = pid_bh // KVH
        kvh = pid_bh % KVH
        rows = tl.program_id(1) * BR + tl.arange(0, BR)
        r_mask = rows < R
        pid_s = tl.program_id(2)
        t = rows % T
        head = kvh * GROUP + rows // T
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + offs_d[None, :], mask=r_mask[:, None], other=0.0)
        m = tl.full((BR,), -1e30, dtype=tl.float32)  # finite: a slice with no visible key gives p = 0, not NaN
        l = tl.zeros((BR,), dtype=tl.float32)
        acc = tl.zeros((BR, D), dtype=tl.float32)
        live, live_blocks, keys_per_split = _live_keys(count_ptr, S, SPLITS, HAS_COUNT, BS)
        s0 = pid_s * keys_per_split
        s1 = tl.minimum(s0 + keys_per_split, live_blocks)
        for start in range(s0, s1, BS):
            offs_s = start + tl.arange(0, BS)
            s_mask = offs_s < s1
            kv_mask = offs_s < live  # past the count: masked keys, not read
            keys = tl.load(k_ptr + b * sk_b + kvh * sk_h + offs_s[:, None] * sk_s + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
            if IEEE:  # float32 inputs: full-precision products (a GPU's default is TF32)
                scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(keys)) * scale
            visible = tl.load(mask_ptr + t[:, None] * sm_t + offs_s[None, :], mask=r_mask[:, None] & s_mask[None, :], other=0)
            scores = tl.where(visible != 0, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            values = tl.load(v_ptr + b * sv_b + kvh * sv_h + offs_s[:, None] * sv_s + offs_d[None, :], mask=kv_mask[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        slot = (pid_bh * SPLITS + pid_s) * R + rows
        r_mask = r_mask & (s0 < live_blocks)
        tl.store(acc_ptr + slot[:, None] * D + offs_d[None, :], acc, mask=r_mask[:, None])
        tl.store(ml_ptr + slot * 2, m, mask=r_mask)
        tl.store(ml_ptr + slot * 2 + 1, l, mask=r_mask)

    @triton.jit
    def _merge_kernel(
        acc_ptr, ml_ptr, count_ptr, out_ptr, T, S, R, KVH, GROUP, SPLITS, so_b, so_t, so_h,
        D: tl.constexpr, BD: tl.constexpr, SP: tl.constexpr, BS: tl.constexpr, HAS_COUNT: tl.constexpr,
        HAS_GATE: tl.constexpr = False, g_ptr=None, sg_b=0, sg_t=0, sg_h=0,
    ):
        """Program (b * KVH + kv head, row, D block): that row's partials of every split that
        held live keys in one [SP, BD] load (SP >= SPLITS), rescaled to their common max,
        summed, normalised and written as out [B, T, H, D] in out's dtype. One program per row
        and D block: the merge is a single memory round trip, not a walk over the splits.
        HAS_GATE: times sigmoid(gate) (Qwen3.5's output gate, [B, T, H, D] at strides sg_*), with the
        torch form's roundings: round(round(out) * round(sigmoid(gate)))."""
        pid_bh = tl.program_id(0)
        row = tl.program_id(1)
        b = pid_bh // KVH
        kvh = pid_bh % KVH
        offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
        _, live_blocks, keys_per_split = _live_keys(count_ptr, S, SPLITS, HAS_COUNT, BS)
        splits = tl.arange(0, SP)
        s_mask = splits * keys_per_split < live_blocks
        slot = (pid_bh * SPLITS + splits) * R + row
        m = tl.load(ml_ptr + slot * 2, mask=s_mask, other=-1e30)
        l = tl.load(ml_ptr + slot * 2 + 1, mask=s_mask, other=0.0)
        part = tl.load(acc_ptr + slot[:, None] * D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        weight = tl.exp(m - tl.max(m, axis=0))
        total = tl.sum(weight * l, axis=0)
        out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        head = kvh * GROUP + row // T
        dt = out_ptr.dtype.element_ty
        if HAS_GATE:
            g = tl.load(g_ptr + b * sg_b + (row % T) * sg_t + head * sg_h + offs_d).to(tl.float32)
            out = out.to(dt).to(tl.float32) * (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + b * so_b + (row % T) * so_t + head * so_h + offs_d, out.to(dt))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_rows_for(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else _MAX_ROWS


def launch_shape(batch: int, kv_heads: int, rows: int, keys: int, processors: int, block_keys: int) -> tuple[int, int]:
    """(splits, keys per split): enough programs for about two per multiprocessor (at most
    _MAX_SPLITS splits), each split a whole number of `block_keys` key blocks."""
    row_blocks = -(-rows // block_rows_for(rows))
    blocks = -(-keys // block_keys)
    splits = max(1, min(blocks, _MAX_SPLITS, -(-2 * processors // (batch * kv_heads * row_blocks))))
    keys_per_split = -(-blocks // splits) * block_keys
    return -(-keys // keys_per_split), keys_per_split


@torch.library.custom_op("qfd::split_attention", mutates_args=())
def split_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, key_count: torch.Tensor | None = None,
                       gate: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel pair as one opaque torch op (torch.compile keeps it whole). Returns [B, T, H, D]
    contiguous (the layout o_proj reads); times sigmoid(gate) [B, T, H, D] where one is given."""

    def launch():
        B, H, T, D = q.shape
        kv_heads, S = k.shape[1], k.shape[2]
        group, rows = H // kv_heads, H // kv_heads * T
        processors = _multiprocessors(q.device.index or 0) if q.is_cuda else 4
        block_rows = block_rows_for(rows)
        block_keys, warps, stages = split_config(D, block_rows, q.dtype)
        splits, _ = launch_shape(B, kv_heads, rows, S, processors, block_keys)
        row_blocks = -(-rows // block_rows)
        acc = torch.empty(B * kv_heads * splits * rows, D, dtype=torch.float32, device=q.device)
        max_sum = torch.empty(B * kv_heads * splits * rows, 2, dtype=torch.float32, device=q.device)
        out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
        # the kernels take any strides but the last dimension's (the cache buffers: always 1)
        qc, kc, vc = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        mask_bytes = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)
        count = key_count if key_count is not None else mask_bytes  # (a pointer the kernels never read)
        _split_kernel[(B * kv_heads, row_blocks, splits)](
            qc, kc, vc, mask_bytes, count, acc, max_sum, T, S, rows, kv_heads, group, splits, D**-0.5,
            qc.stride(0), qc.stride(1), qc.stride(2), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), mask_bytes.stride(0),
            D=D, BR=block_rows, BS=block_keys, IEEE=q.dtype == torch.float32, HAS_COUNT=key_count is not None, num_warps=warps, num_stages=stages,
        )
        block_d = min(D, 64)
        _merge_kernel[(B * kv_heads, rows, D // block_d)](
            acc, max_sum, count, out, T, S, rows, kv_heads, group, splits, out.stride(0), out.stride(1), out.stride(2),
            D=D, BD=block_d, SP=max(16, triton.next_power_of_2(splits)), BS=block_keys, HAS_COUNT=key_count is not None, num_warps=4,
            **({} if gate is None else dict(HAS_GATE=True, g_ptr=gate, sg_b=gate.stride(0), sg_t=gate.stride(1), sg_h=gate.stride(2))),
        )
        return out

    def torch_path():  # where the kernels failed: the served torch attention, in this op's layout
        from qfd.models.target import grouped_attention  # (target.py imports this module)

        out = grouped_attention(q, k, v, mask).transpose(1, 2).contiguous()
        return out if gate is None else out * torch.sigmoid(gate)

    return launch_or_fallback("split_attention", launch, torch_path)


@split_attention_op.register_fake
def _split_attention_fake(q, k, v, mask, key_count=None, gate=None):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, key_count: torch.Tensor | None = None,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """Step attention through the kernels: q [B, H, T, D], k/v [B, KVH, S, D] (a cache buffer,
    read in place), mask [T, S] bool. key_count: an integer tensor [1] on q's device, the number
    of leading keys the mask can show (the step's last position + 1; keys from there on must be
    masked): the kernels read only those, so a step at a short context in a long static cache
    does not stream the whole buffer. A tensor, not a Python int, so a CUDA graph replays it at
    any position. gate [B, T, H, D] (unit stride along D): the output times sigmoid(gate), in the
    merge kernel. Returns [B, H, T, D] (a transposed view of [B, T, H, D])."""
    return split_attention_op(q, k, v, mask, key_count, gate).transpose(1, 2)
