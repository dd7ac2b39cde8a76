"""Launch configurations of the INT4 Triton kernels (`qfd.kernels.int4_triton`): the
`KernelConfig` fields, the environment knobs that change the defaults (each with what it
measured), the tuned table per GPU model, and the heuristic for shapes without an entry.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from qfd.kernels.int4_layout import TILE_K


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters. use_dot: tensor-core path (BM rows per program, BM >= 16) vs the
    CUDA-core path (one row per program). tiles > 0 (one row, group a multiple of 128):
    `_int4_gemv_kernel` with that many K tiles per loop step, offset_sum its arithmetic, or
    with two_slot (bf16 x) `_int4_gemv_two_slot_kernel`."""

    use_dot: bool
    block_n: int
    split_k: int
    num_warps: int = 4
    block_m: int = 16
    num_stages: int = 1
    tiles: int = 0
    offset_sum: bool = False
    two_slot: bool = False  # tiles > 0, bf16 x: `_int4_gemv_two_slot_kernel` (offset_sum does not apply)
    magic: bool | None = None  # tensor-core path, 16-bit x: the MAGIC_BITS operand (None: MAGIC_DOT)
    pdl: bool | None = None  # programmatic dependent launch on Hopper and later (None: PDL_LAUNCH)
    w_first: bool | None = None  # tensor-core path: weights as the dot's first operand (None: W_FIRST_DOT)
    mma16: bool | None = None  # tensor-core path, 16-bit x: `_int4_mma_kernel` (None: MMA16)


# The tensor-core path's weight operand built straight in 16 bits (`_int4_mm_kernel`'s
# MAGIC_BITS) for configs that do not say: QFD_INT4_MAGIC=1 turns it on. Measured slower
# (0.53-0.72x summed at 1/16/32 rows on the H100, docs/benchmarks.md 2026-12-05 ninth session:
# fewer ALU ops per weight, but the 16-bit operand's conversion into the MMA layout costs more),
# so it stays off; kept for side-by-side runs on other GPUs (bench_int4_kernels.py --ab).
MAGIC_DOT = os.environ.get("QFD_INT4_MAGIC", "0") == "1"
# 17-32 rows (a 32-node tree verify) as one 32-row block instead of two 16-row blocks that
# each dequantize the whole weight: 1.13x summed over the fused + drafter shapes at 32 rows
# (H100, docs/benchmarks.md 2026-12-05 ninth session); QFD_INT4_BM32=0 for the old blocks.
BLOCK_M_32 = os.environ.get("QFD_INT4_BM32", "1") == "1"
# Programmatic dependent launch (Hopper and later; QFD_INT4_PDL=1): the kernel may start while
# the one before it finishes - its first weight tile loads before `gdc_wait` (weights are
# constants; x and every store come after it). Measured (H100, docs/benchmarks.md 2026-12-06
# fourteenth session): 1.01-1.04x for a chain of INT4 products alone, but 7-10% slower steps -
# in a model the kernel before a product is a norm or a GDN/attention kernel, whose SMs the
# early-launched programs occupy while they wait. So it stays off.
PDL_LAUNCH = os.environ.get("QFD_INT4_PDL", "0") == "1"
# The tensor-core path with the weights as the dot's first operand (`_int4_mm_kernel`'s W_FIRST:
# y.T = w @ x.T, the MMA's M the outputs, its N the 2-32 rows): QFD_INT4_WFIRST=1. Tried because
# a 16-row product streams its weights at ~1.1 TB/s against cuBLAS's ~3 and Hopper's warpgroup
# MMA takes only its first operand from registers. Measured (H100, docs/benchmarks.md 2026-12-06
# fourteenth session): 0.95x at 16 rows, 1.06x at 32 (kernel level only) - the orientation is not
# the bottleneck, so it stays off.
W_FIRST_DOT = os.environ.get("QFD_INT4_WFIRST", "0") == "1"
# The tensor-core path through `_int4_mma_kernel` (pipelined loads, two weights per lop3 as the
# warpgroup MMA's register operand) for 16-bit x. On by default for products of 2 rows and more:
# its first form measured 1.17x at 16 rows and 1.21x at 32 over `_int4_mm_kernel` (H100,
# docs/benchmarks.md 2026-12-06 sixteenth session); the paired-nibble form another 1.03-1.06x /
# up to 1.24x at the same launch configs of 64 outputs per program (H200, seventeenth session).
# QFD_INT4_MMA16=0 restores the old kernel; QFD_INT4_MMA16=all also sends one-row products (the
# decode) through it as a 16-row block, which lost there in its first form (0.88x summed).
_MMA16_KNOB = os.environ.get("QFD_INT4_MMA16", "1")
MMA16 = _MMA16_KNOB in ("1", "all")
MMA16_ONE_ROW = _MMA16_KNOB == "all"
# One-row products through `_int4_gemv_two_slot_kernel` (QFD_INT4_GEMV=two_slot), whatever the
# tuned table says: each keeps its table entry's outputs per program and K split (tiles 1 where
# the entry is another kernel's). For A/B runs before a sweep has put the kernel in the table.
GEMV_TWO_SLOT = os.environ.get("QFD_INT4_GEMV", "") == "two_slot"


# Tuned launch configs per GPU model: qfd/kernels/tuned/<device name>.json, written by
# `bench/bench_int4_kernels.py --sweep --write-tuned` on that GPU ({"device": ..., "configs":
# [{"m": 1 | 16 | 32, "n": N, "k": K, <KernelConfig fields>}, ...]}). A product of 1 row looks up
# m = 1, of 2-16 rows m = 16, of 17-32 rows (a 32-node tree verify) m = 32 - with 32-row blocks
# (QFD_INT4_BM32) only; shapes or GPUs without an entry use `heuristic_config`.
TUNED_DIR = Path(__file__).with_name("tuned")


def tuned_file(device_name: str) -> Path:
    return TUNED_DIR / (re.sub(r"[^A-Za-z0-9._-]+", "_", device_name) + ".json")


@functools.lru_cache(maxsize=None)
def tuned_configs(device_name: str) -> dict[tuple[int, int, int], KernelConfig]:
    """(m, n, k) -> KernelConfig from the device's tuned file ({} without one)."""
    path = tuned_file(device_name)
    if not path.is_file():
        return {}
    fields = set(KernelConfig.__dataclass_fields__)
    table = {}
    for entry in json.loads(path.read_text())["configs"]:
        table[(entry["m"], entry["n"], entry["k"])] = KernelConfig(**{key: v for key, v in entry.items() if key in fields})
    return table


@functools.lru_cache(maxsize=None)
def _current_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def pick_config(m: int, n: int, k: int, device: torch.device | None = None) -> KernelConfig:
    """Launch config for an M x K @ K x N product on `device`: the GPU's tuned entry for
    (1, 16 or 32 rows, N, K) when it has one, else `heuristic_config`; one row as a 16-row
    `_int4_mma_kernel` block under QFD_INT4_MMA16=all, through `_int4_gemv_two_slot_kernel` under
    QFD_INT4_GEMV=two_slot."""
    if m == 1 and MMA16_ONE_ROW:
        return replace(heuristic_config(16, n, k), mma16=True)
    if m == 1 and GEMV_TWO_SLOT:
        return as_two_slot(_table_or_heuristic(1, n, k, device))
    return _table_or_heuristic(m, n, k, device)


def as_two_slot(cfg: KernelConfig) -> KernelConfig:
    """A one-row config through `_int4_gemv_two_slot_kernel`, keeping its outputs per program,
    K split and warps (1 tile a step where it was another kernel's)."""
    return replace(cfg, use_dot=False, tiles=cfg.tiles or 1, two_slot=True, offset_sum=False, num_stages=1, mma16=None)


def _table_or_heuristic(m: int, n: int, k: int, device: torch.device | None) -> KernelConfig:
    """The GPU's tuned entry for (1, 16 or 32 rows, N, K), else `heuristic_config`."""
    rows_key = 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 and BLOCK_M_32 else None
    if device is not None and device.type == "cuda" and rows_key is not None:
        tuned = tuned_configs(_current_device_name(device.index if device.index is not None else torch.cuda.current_device()))
        cfg = tuned.get((rows_key, n, k))
        if cfg is not None:
            # QFD_INT4_MMA16=0 holds for tuned entries too (the H100's 2-32-row entries were swept
            # with the new kernel, so the older one then runs launch configs tuned for it, not for itself)
            return cfg if MMA16 or not cfg.mma16 else replace(cfg, mma16=False)
    return heuristic_config(m, n, k)


def heuristic_config(m: int, n: int, k: int) -> KernelConfig:
    """Launch config for shapes without a tuned entry. One row, read off the H200 sweep of
    bench/bench_int4_kernels.py --sweep at Qwen3.5-4B's shapes (docs/benchmarks.md, 2026-12-04
    fifth session; L2-hot weights): 64 outputs per program, K split 8. 2+ rows, from the H200
    sweep of the paired-nibble `_int4_mma_kernel` (2026-12-06, seventeenth session): 64 outputs
    per program, three pipeline stages, K split 4 for N >= 4096 (the sweep's best single config
    over its shapes at 16 and at 32 rows); 128 outputs per program lost there to the registers
    they take (0.74-0.86x at the same splits); below 2048 outputs, 32 and K split 8."""
    kt = -(-k // TILE_K)
    if m == 1:
        cfg = KernelConfig(use_dot=False, block_n=64, split_k=8)
    elif n >= 4096:
        cfg = KernelConfig(use_dot=True, block_n=64, split_k=4, num_stages=3)
    else:
        cfg = KernelConfig(use_dot=True, block_n=64 if n >= 2048 else 32, split_k=8, num_stages=2)
    split = cfg.split_k
    while split > 1 and split > kt:  # every split needs at least one K tile
        split //= 2
    if BLOCK_M_32 and 16 < m <= 32:
        cfg = replace(cfg, block_m=32)
    return replace(cfg, split_k=split)
