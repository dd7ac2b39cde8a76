"""W4A16 matmul in Triton: y = x @ w_hat.T (+ b), w_hat = (q - z) * s, for decode (M = 1) and
speculative verify (M = 16) row counts, correct for any M.

Layout of the packed operands: `qfd.kernels.int4_layout`; launch configs and their knobs:
`qfd.kernels.int4_configs`.

Dequantization in registers: u | 0x4B000000 read as float is 2^23 + u exactly, so
(2^23 + u) - (2^23 + z) gives q - z with one subtract (no int->float conversion). Group
scales multiply a per-group partial sum, not every weight. fp32 accumulation throughout.

Split-K (SPLIT_K > 1): each program writes its fp32 partial tile to a workspace, bumps a
per-output-tile counter; the last program of a tile sums the partials in split order
(deterministic) and writes y, then resets the counter: one launch, no memset, graph-safe.

GATED (an MLP's gate/up pair, `Int4Linear.gated_pair`): the weight's outputs interleave gate
and up column by column (`interleave_columns`), so every tile holds both halves of its outputs
and its store writes silu(gate) * up [M, N / 2] (`_store_y`): the MLP's activation costs no
kernel of its own, and half the output bytes. Static SASS (bench/sass_fusions.py): the main loops
are unchanged. H100: 1.07-1.12x the plain product + compiled activation at 1, 16 and 32 rows.
"""

from __future__ import annotations

import torch

from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, int4_configs as configs, interpreting, runs_on, tl, triton  # noqa: F401 (tl: the kernels)
from qfd.kernels.int4_configs import KernelConfig, pick_config
from qfd.kernels.int4_layout import TILE_K, TritonInt4Weight, reference_matmul


def available() -> bool:
    """True when the Triton kernel can run here: triton importable and a CUDA device (or the
    CPU interpreter, TRITON_INTERPRET=1, for tests)."""
    return _HAVE_TRITON and (torch.cuda.is_available() or interpreting())


# --------------------------------------------------------------------------- kernel

if _HAVE_TRITON:

    @triton.jit
    def _nibble_k(j):
        """K offset within its 128-wide tile of nibble j's first weight (packed row 0): nibble j
        of packed row p holds k = 32 (j mod 4) + j // 4 + 2p (`pack_for_triton`)."""
        return 32 * (j % 4) + j // 4

    @triton.jit
    def _prefetch_next(pf_ptr, pf_lines, PREFETCH: tl.constexpr, PF: tl.constexpr):
        """PREFETCH: ask the L2 for this program's share of the next product's packed weights
        (pf_lines 128-byte lines from pf_ptr, split evenly over the grid), PF lines per
        instruction. `prefetch.global.L2` is fire and forget: no register waits on it, so the
        program goes on with its own product while HBM, otherwise idle in the small kernels
        between two products, fills the L2 for the next one."""
        if PREFETCH:
            prog = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
            programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
            per = tl.cdiv(pf_lines, programs)
            first = prog * per
            for i in range(0, per, PF):
                line = tl.minimum(first + i + tl.arange(0, PF), pf_lines - 1)  # past the end: the last line again
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [pf_ptr + line.to(tl.int64) * 32],
                                          dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _store_y(val, out_m, offs_n, out_mask, y_ptr, stride_ym, M, N, GATED: tl.constexpr):
        """Store an fp32 tile val [rows, BN] into y. GATED: the tile's columns interleave a gate and
        an up projection (2i, 2i + 1 -> output i, `interleave_columns`) and y [rows, N / 2] gets
        silu(gate) * up, each rounded to y's dtype first as an unfused product would store them:
        the MLP's activation without a kernel of its own."""
        y_dtype = y_ptr.dtype.element_ty
        if GATED:
            ROWS: tl.constexpr = val.shape[0]
            HALF: tl.constexpr = val.shape[1] // 2
            gate, up = tl.split(tl.reshape(val, (ROWS, HALF, 2)))
            gate = gate.to(y_dtype).to(tl.float32)
            up = up.to(y_dtype).to(tl.float32)
            val = gate / (1.0 + tl.exp(-gate)) * up  # (the form the H100 timed; tl.sigmoid compiles to 8 instructions more)
            # The outputs' columns and mask computed afresh rather than split from offs_n: Triton
            # then knows they are contiguous and stores vectors, not one 2-byte value at a time.
            # program_id(0) is the tile's column block in every kernel form.
            offs_n = tl.program_id(0) * HALF + tl.arange(0, HALF)
            out_mask = (out_m < M)[:, None] & (offs_n < N // 2)[None, :]
        tl.store(y_ptr + out_m[:, None] * stride_ym + offs_n[None, :], val.to(y_dtype), mask=out_mask)

    @triton.jit
    def _write_out(out, out_m, offs_n, out_mask, n_mask, y_ptr, ws_ptr, cnt_ptr, b_ptr, stride_ym, M, N, tile_id, pid_k,
                   SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
        """Store a program's fp32 tile `out` [rows, BN] (+ bias) into y (`_store_y`). Split-K: write
        the partial to the workspace, bump the tile's counter; the last split of the tile sums the
        partials in split order (deterministic), writes y and resets the counter for the next launch."""
        if SPLIT_K == 1:
            if HAS_BIAS:
                out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            _store_y(out, out_m, offs_n, out_mask, y_ptr, stride_ym, M, N, GATED)
        else:
            ws_tile = ws_ptr + out_m[:, None] * N + offs_n[None, :]
            tl.store(ws_tile + pid_k * M * N, out, mask=out_mask)
            tl.debug_barrier()  # all threads' partial stores precede the release below
            arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # last split of this tile: reduce in split order
                total = tl.load(ws_tile, mask=out_mask, other=0.0, cache_modifier=".cg")
                for sk in range(1, SPLIT_K):
                    total += tl.load(ws_tile + sk * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                _store_y(total, out_m, offs_n, out_mask, y_ptr, stride_ym, M, N, GATED)
                tl.atomic_xchg(cnt_ptr + tile_id, 0)  # ready for the next launch

    @triton.jit
    def _program_block(M, N, KT, BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr):
        """A tensor-core program's share of the product: program ids (n, k split, m), its
        outputs and rows with their masks, and its K tiles [t0, t1)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_m = pid_m * BM + tl.arange(0, BM)
        tiles_per = tl.cdiv(KT, SPLIT_K)
        t0 = pid_k * tiles_per
        t1 = tl.minimum(t0 + tiles_per, KT)
        return pid_n, pid_k, pid_m, offs_n, offs_n < N, offs_m, offs_m < M, t0, t1

    @triton.jit
    def _along_n(v, W_FIRST: tl.constexpr):
        """A per-output vector [BN] broadcast against a tile: [BN, 1] when the tile is weights-first
        ([BN, rows] or [BN, 16]), else [1, BN]."""
        if W_FIRST:
            return v[:, None]
        else:
            return v[None, :]

    @triton.jit
    def _along_m(v, W_FIRST: tl.constexpr):
        """A per-row vector [BM] broadcast against the accumulator (the transpose of `_along_n`)."""
        if W_FIRST:
            return v[None, :]
        else:
            return v[:, None]

    @triton.jit
    def _dot_slice(w, xj, acc, W_FIRST: tl.constexpr, DOT_IEEE: tl.constexpr):
        """One 16-wide K slice on the tensor cores, + acc (None: a new sum): w [BN, 16] @ xj
        [16, BM] weights-first, else xj [BM, 16] @ w [16, BN]."""
        if W_FIRST:
            a = w
            b = xj
        else:
            a = xj
            b = w
        if DOT_IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _int4_mm_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, KT, stride_xm, stride_ym,
        GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
        DOT_IEEE: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr, PDL: tl.constexpr, W_FIRST: tl.constexpr,
        EVEN_K: tl.constexpr, pf_ptr, pf_lines, PREFETCH: tl.constexpr = False, PF: tl.constexpr = 128, GATED: tl.constexpr = False,
    ):
        """One program: rows [BM*pid_m, +BM) x outputs [BN*pid_n, +BN) x K tiles of split pid_k.

        W_FIRST (tensor-core path): the weights are the dot's first operand - the transposed
        product y.T [BN, BM] = w [BN, 16] @ x.T [16, BM] per K slice - so the MMA's M is BN
        (>= 64: Hopper's warpgroup MMA, which takes its first operand from registers, where the
        dequantized weights already are) and the few rows are its N; the tile is transposed
        once, at the end. Otherwise x [BM, 16] @ w [16, BN], the weights as the second operand.

        MAGIC_BITS > 0 (tensor-core path, x bf16 / fp16): the dot's weight operand is built in
        x's 16-bit format straight from the nibble - u | MAGIC_BITS is MAGIC + u exactly (bf16
        0x4300 = 128, fp16 0x6400 = 1024: integers are exact there) - so a weight costs a shift
        and a mask-or, with no float subtract and no fp32 -> 16-bit conversion. The offset comes
        off per group: sum x (MAGIC + u) - (MAGIC + z) sum x = sum x (u - z), fp32 accumulation."""
        pid_n, pid_k, pid_m, offs_n, n_mask, offs_m, m_mask, t0, t1 = _program_block(M, N, KT, BM, BN, SPLIT_K)
        _prefetch_next(pf_ptr, pf_lines, PREFETCH, PF)
        offs_p = tl.arange(0, 16)
        x_dtype = x_ptr.dtype.element_ty

        if W_FIRST:
            acc = tl.zeros((BN, BM), dtype=tl.float32)  # y.T
        elif USE_DOT:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        else:
            acc = tl.zeros((16, BN), dtype=tl.float32)  # reduced over its 16 rows at the end
        xg = tl.zeros((BM,), dtype=tl.float32)  # MAGIC_BITS: the group's sum of x per row
        # a tile's 16 packed rows: [16, BN], or [BN, 16] weights-first (still coalesced along N)
        q_rows = q_ptr + _along_m(offs_p, W_FIRST) * N + _along_n(offs_n, W_FIRST)
        q_mask = (_along_m(offs_p, W_FIRST) < 16) & _along_n(n_mask, W_FIRST)  # the full shape of a tile load
        zero_p = _along_m(offs_p, W_FIRST) * 0  # tile indices as tensors: a scalar compare in a mask trips Triton's interpreter
        p_next = tl.load(q_rows + t0 * 16 * N, mask=q_mask & (zero_p + t0 < t1), other=0)
        if PDL:  # the weights above are constant: only x (and any store) waits for the kernel before
            tl.extra.cuda.gdc_wait()
        for t in range(t0, t1):
            p_cur = p_next
            # prefetch the next tile while this one is dequantized (two tiles in flight)
            p_next = tl.load(q_rows + (t + 1) * 16 * N, mask=q_mask & (zero_p + t + 1 < t1), other=0)
            for i in tl.static_range(8):  # the tile's eight 16-wide K slices in K order
                # slice i: k = 32 (i // 2) + i % 2 + 2p, nibble j = i // 2 + 4 (i % 2); a group starts at
                # an even slice (16 i % GROUP == 0) and ends at an odd one (16 (i + 1) % GROUP == 0)
                j = i // 2 + 4 * (i % 2)
                k0 = t * 128 + _nibble_k(j)
                if i % 2 == 0 and (16 * i) % GROUP == 0:  # a new group: its scale/zero
                    g = (k0 - i % 2) // GROUP
                    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                    offset = MAGIC if MAGIC_BITS > 0 else 8388608.0  # 2^23 below
                    if HAS_ZEROS:
                        c = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32) + offset
                    else:
                        c = tl.full((BN,), 8.0, tl.float32) + offset
                offs_k = k0 + 2 * offs_p
                if USE_DOT:  # x's slice: [BM, 16], or [16, BM] (x.T) weights-first
                    xj = tl.load(x_ptr + _along_m(offs_m, W_FIRST) * stride_xm + _along_n(offs_k, W_FIRST),
                                 mask=_along_m(m_mask, W_FIRST) & _along_n(offs_k < K, W_FIRST), other=0.0)
                if MAGIC_BITS > 0:
                    w = (((p_cur >> (4 * j)) & 0xF) | MAGIC_BITS).to(tl.int16).to(x_dtype, bitcast=True)  # MAGIC + u
                    if W_FIRST:
                        xs = tl.sum(xj.to(tl.float32), axis=0)
                    else:
                        xs = tl.sum(xj.to(tl.float32), axis=1)
                    if i % 2 == 0 and (16 * i) % GROUP == 0:
                        part = _dot_slice(w, xj, None, W_FIRST, False)
                        xg = xs
                    else:
                        part = _dot_slice(w, xj, part, W_FIRST, False)
                        xg += xs
                    if i % 2 == 1 and ((16 * (i + 1)) % GROUP == 0 or i == 7):  # group (or tile) ends: offset off, scale
                        acc += (part - _along_m(xg, W_FIRST) * _along_n(c, W_FIRST)) * _along_n(s, W_FIRST)
                else:
                    bits = ((p_cur >> (4 * j)) & 0xF) | 0x4B000000
                    w = bits.to(tl.float32, bitcast=True) - _along_n(c, W_FIRST)  # exact q - z
                    if USE_DOT:
                        if i % 2 == 0 and (16 * i) % GROUP == 0:
                            part = _dot_slice(w.to(x_dtype), xj, None, W_FIRST, DOT_IEEE)
                        else:
                            part = _dot_slice(w.to(x_dtype), xj, part, W_FIRST, DOT_IEEE)
                        if i % 2 == 1 and ((16 * (i + 1)) % GROUP == 0 or i == 7):  # group (or tile) ends: scale it
                            acc += part * _along_n(s, W_FIRST)
                    else:
                        if EVEN_K:  # K % 128 == 0: every slice lies inside x (the mask cost ~0.8 instructions per weight)
                            xj = tl.load(x_ptr + pid_m * stride_xm + offs_k).to(tl.float32)
                        else:
                            xj = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
                        if i % 2 == 0 and (16 * i) % GROUP == 0:
                            part = w * xj[:, None]
                        else:
                            part += w * xj[:, None]
                        if i % 2 == 1 and ((16 * (i + 1)) % GROUP == 0 or i == 7):
                            acc += part * s[None, :]

        if PDL:  # the next kernel may start its own weight loads now
            tl.extra.cuda.gdc_launch_dependents()
        if USE_DOT:
            if W_FIRST:
                out = tl.trans(acc)
            else:
                out = acc
            out_m = offs_m
            out_mask = m_mask[:, None] & n_mask[None, :]
        else:
            out = tl.sum(acc, axis=0)[None, :]  # [1, BN]
            out_m = pid_m + tl.arange(0, 1)
            out_mask = (out_m < M)[:, None] & n_mask[None, :]
        _write_out(out, out_m, offs_n, out_mask, n_mask, y_ptr, ws_ptr, cnt_ptr, b_ptr, stride_ym, M, N,
                   pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K, HAS_BIAS, GATED)



if _HAVE_TRITON:

    @triton.jit
    def _weight_pairs(words, MAGIC_BITS: tl.constexpr, USE_ASM: tl.constexpr):
        """(words & 0x000F000F) | MAGIC_BITS in both halves: the two nibbles as MAGIC + u, two
        16-bit floats in one register. USE_ASM: as one lop3 with both masks immediate - written
        as Triton ops, ptxas spends two (LOP3 takes one immediate), and a runtime operand instead
        makes Triton send the operand through shared memory. The interpreter runs the plain ops."""
        if USE_ASM:
            if MAGIC_BITS == 0x4300:  # bf16 128.0 in both halves: 0x43004300
                return tl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1124090624, 234;", "=r,r", [words], dtype=tl.int32, is_pure=True, pack=1)
            else:  # fp16 1024.0: 0x64006400
                return tl.inline_asm_elementwise("lop3.b32 $0, $1, 983055, 1677747200, 234;", "=r,r", [words], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return (words & 0x000F000F) | (MAGIC_BITS * 65537)

    @triton.jit
    def _float_128_plus(placed, USE_ASM: tl.constexpr):
        """The float32 128 + u for the nibble u at bits 16-19 of `placed` (mantissa bits of 128.0,
        whose unit there is 1): (placed & 0x000F0000) | 0x43000000, one lop3 with USE_ASM (see
        `_weight_pairs`)."""
        if USE_ASM:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 983040, 1124073472, 234;", "=r,r", [placed], dtype=tl.int32, is_pure=True, pack=1)
        else:
            bits = (placed & 0x000F0000) | 0x43000000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _int4_mma_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, KT, stride_xm, stride_ym,
        GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr,
        EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
        pf_ptr, pf_lines, PREFETCH: tl.constexpr = False, PF: tl.constexpr = 128, GATED: tl.constexpr = False,
    ):
        """The tensor-core path for 16-bit x (bf16 / fp16), built from its static SASS (sm_90,
        compiled offline, bench/sass_int4.py):
        - each K tile's packed words are loaded inside the loop, so Triton's pipeliner stages them
          through shared memory (cp.async);
        - the weights are the dot's first operand, y.T [BN, BM] = w [BN, 32] @ x.T [32, BM] per
          32-wide K slice: the outputs are the MMA's M (Hopper's warpgroup MMA, which takes that
          operand from registers, where the weights are built) and the rows its N;
        - one mask-or per packed word gives two weights as MAGIC + u in x's 16-bit format (bf16
          0x4300 = 128, fp16 0x6400 = 1024: integers exact there), a K-adjacent pair already in
          the register layout the MMA operand wants (`pack_for_triton`); one paired subtract of
          MAGIC + z (exact for z <= 128, the packed range) leaves q - z exactly: ~2.7-3.4
          instructions per weight in the loop, against ~4-4.5 for the form that built one
          weight per op and paired them by permutes.
        Group scales multiply each group's fp32 partial sum, as in `_int4_mm_kernel`.
        EVEN_M / EVEN_N / EVEN_K (M % BM, N % BN, K % 128 all zero): the loads go unmasked."""
        pid_n, pid_k, pid_m, offs_n, n_mask, offs_m, m_mask, t0, t1 = _program_block(M, N, KT, BM, BN, SPLIT_K)
        _prefetch_next(pf_ptr, pf_lines, PREFETCH, PF)
        offs_p = tl.arange(0, 16)
        offs_r = tl.arange(0, 32)
        x_dtype = x_ptr.dtype.element_ty
        acc = tl.zeros((BN, BM), dtype=tl.float32)  # y.T
        q_cols = q_ptr + offs_p[None, :] * N + offs_n[:, None]  # a tile's 16 packed rows as [BN, 16]
        q_mask = n_mask[:, None] & (offs_p[None, :] < 16)
        for t in range(t0, t1):
            if EVEN_N:
                words = tl.load(q_cols + t * 16 * N)
            else:
                words = tl.load(q_cols + t * 16 * N, mask=q_mask, other=0)
            for j in tl.static_range(4):  # 32-wide K slices
                k0 = t * 128 + 32 * j
                if (32 * j) % GROUP == 0:  # a new group starts at this slice: its scale, its MAGIC + z
                    g = k0 // GROUP
                    if EVEN_N:
                        s = tl.load(s_ptr + g * N + offs_n).to(tl.float32)
                    else:
                        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                    if HAS_ZEROS:  # MAGIC + z: exact in bf16 for z <= 128 (pack_for_triton's range)
                        c = (tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32) + MAGIC).to(x_dtype)
                    else:
                        c = tl.full((BN,), MAGIC + 8.0, x_dtype)
                pairs = _weight_pairs(words >> (4 * j), MAGIC_BITS, USE_ASM)  # [BN, 16]: k = 2p, 2p + 1 of the slice
                low = pairs.to(tl.int16).to(x_dtype, bitcast=True)
                high = (pairs >> 16).to(tl.int16).to(x_dtype, bitcast=True)
                w = tl.reshape(tl.join(low, high), (BN, 32)) - c[:, None]  # exact q - z, column 2p + e = k0 + 2p + e
                offs_k = k0 + offs_r
                x_cols = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x.T's slice [32, BM]
                if EVEN_M and EVEN_K:
                    xj = tl.load(x_cols)
                elif EVEN_M:
                    xj = tl.load(x_cols, mask=(offs_k < K)[:, None], other=0.0)
                elif EVEN_K:
                    xj = tl.load(x_cols, mask=m_mask[None, :], other=0.0)
                else:
                    xj = tl.load(x_cols, mask=m_mask[None, :] & (offs_k < K)[:, None], other=0.0)
                if (32 * j) % GROUP == 0:
                    part = tl.dot(w, xj)
                else:
                    part = tl.dot(w, xj, part)
                if (32 * (j + 1)) % GROUP == 0 or j == 3:  # group (or tile) ends: scale it
                    acc += part * s[:, None]
        _write_out(tl.trans(acc), offs_m, offs_n, m_mask[:, None] & n_mask[None, :], n_mask, y_ptr, ws_ptr, cnt_ptr, b_ptr, stride_ym, M, N,
                   pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K, HAS_BIAS, GATED)


if _HAVE_TRITON:

    @triton.jit
    def _int4_gemv_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        N, K, KT,
        GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
        BN: tl.constexpr, TILES: tl.constexpr, SPLIT_K: tl.constexpr, OFFSET_SUM: tl.constexpr, PDL: tl.constexpr,
        USE_ASM: tl.constexpr, EVEN_K: tl.constexpr, pf_ptr, pf_lines, PREFETCH: tl.constexpr = False, PF: tl.constexpr = 128,
        GATED: tl.constexpr = False,
    ):
        """One row (decode): outputs [BN*pid_n, +BN) x the K steps of split pid_k, a step being
        TILES whole K tiles (16*TILES contiguous packed rows: one [16*TILES, BN] load). Needs
        GROUP % 128 == 0, so every packed row of a tile shares one scale.

        Per weight: a shift and a mask-or give a float, one FMA accumulates it; group scales
        multiply each step's partial sums, one reduction over rows at the end.
        OFFSET_SUM=False: w = (2^23 + u) - (2^23 + z), exact q - z, as `_int4_mm_kernel`.
        OFFSET_SUM=True: f = 128 + u (the nibble placed at mantissa bits 16-19 of 128.0, one
        mask-or: `_float_128_plus`), no subtract per weight; sum f x = 128 X + sum u x with
        X = sum x over the tile, so y = sum s f x - sum_t s_t (128 + z_t) X_t. One ALU op less
        per weight, at the cost of a cancellation (~4 bits of fp32's 24, far below bf16's
        rounding)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        R: tl.constexpr = 16 * TILES
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        offs_r = tl.arange(0, R)
        row_tile = offs_r // 16  # which of the step's tiles a packed row belongs to
        steps = tl.cdiv(KT, TILES)
        per_split = tl.cdiv(steps, SPLIT_K)
        s0 = pid_k * per_split
        s1 = tl.minimum(s0 + per_split, steps)
        acc = tl.zeros((R, BN), dtype=tl.float32)
        corr = tl.zeros((BN,), dtype=tl.float32)
        _prefetch_next(pf_ptr, pf_lines, PREFETCH, PF)
        if PDL:  # x is the previous kernel's output
            tl.extra.cuda.gdc_wait()
        for step in range(s0, s1):
            t_rows = step * TILES + row_tile  # [R] tile of each packed row
            r_mask = t_rows < KT
            words = tl.load(q_ptr + (step * R + offs_r)[:, None] * N + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0)
            g_rows = t_rows * 128 // GROUP
            s_rows = tl.load(s_ptr + g_rows[:, None] * N + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
            if not OFFSET_SUM:
                if HAS_ZEROS:
                    c = tl.load(z_ptr + g_rows[:, None] * N + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0).to(tl.float32) + 8388608.0
                else:
                    c = 8388616.0  # 2^23 + 8
            part = tl.zeros((R, BN), dtype=tl.float32)
            xsum = tl.zeros((R,), dtype=tl.float32)
            for j in tl.static_range(8):
                offs_k = t_rows * 128 + _nibble_k(j) + 2 * (offs_r % 16)
                if EVEN_K:  # K % 128 == 0 and whole steps: every row lies inside x
                    xj = tl.load(x_ptr + offs_k).to(tl.float32)
                else:
                    xj = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
                if OFFSET_SUM:
                    if 4 * j <= 16:
                        placed = words << (16 - 4 * j)
                    else:
                        placed = words >> (4 * j - 16)
                    f = _float_128_plus(placed, USE_ASM)  # 128 + u
                    xsum += xj
                else:
                    f = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - c
                part += f * xj[:, None]
            acc += part * s_rows
            if OFFSET_SUM:
                # the per-tile X_t and scales: [TILES] and [TILES, BN]
                x_tiles = tl.sum(tl.reshape(xsum, (TILES, 16)), axis=1)
                t_ids = step * TILES + tl.arange(0, TILES)
                t_mask = (t_ids < KT)[:, None] & n_mask[None, :]
                g_ids = t_ids * 128 // GROUP
                s_t = tl.load(s_ptr + g_ids[:, None] * N + offs_n[None, :], mask=t_mask, other=0.0).to(tl.float32)
                if HAS_ZEROS:
                    z_t = tl.load(z_ptr + g_ids[:, None] * N + offs_n[None, :], mask=t_mask, other=0).to(tl.float32)
                else:
                    z_t = 8.0
                corr += tl.sum(s_t * (128.0 + z_t) * x_tiles[:, None], axis=0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        out = tl.sum(acc, axis=0)
        if OFFSET_SUM:
            out = out - corr
        row = tl.arange(0, 1)
        _write_out(out[None, :], row, offs_n, (row < 1)[:, None] & n_mask[None, :], n_mask, y_ptr, ws_ptr, cnt_ptr, b_ptr, N, 1, N,
                   pid_n, pid_k, SPLIT_K, HAS_BIAS, GATED)


    @triton.jit
    def _slot_float(v, SLOT: tl.constexpr, USE_ASM: tl.constexpr):
        """The float32 MAGIC + u for the nibble u at bits SLOT..SLOT+3 of v, one lop3 with USE_ASM
        (see `_weight_pairs`): SLOT 16 in the mantissa of 128.0 (unit 1 there: 128 + u), SLOT 12
        in that of 2048.0 (2048 + u)."""
        if SLOT == 16:
            return _float_128_plus(v, USE_ASM)
        if USE_ASM:
            bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 61440, 1157627904, 234;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
        else:
            bits = (v & 0x0000F000) | 0x45000000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _rotate_16(v, USE_ASM: tl.constexpr):
        """v with its 16-bit halves swapped (one prmt with USE_ASM)."""
        if USE_ASM:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 4146;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return (v << 16) | ((v >> 16) & 0xFFFF)

    @triton.jit
    def _x_pair(x_pairs, at, K, EVEN_K: tl.constexpr):
        """bf16 x[2 at], x[2 at + 1] from one 32-bit load, each widened to float32 (a bf16 is
        the top half of its float32): past K, zeros."""
        if EVEN_K:
            v = tl.load(x_pairs + at)
        else:
            v = tl.load(x_pairs + at, mask=2 * at < K, other=0)
        return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _int4_gemv_two_slot_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        N, K, KT,
        GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
        BN: tl.constexpr, TILES: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_ASM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, pf_ptr, pf_lines, PREFETCH: tl.constexpr = False,
        PF: tl.constexpr = 128, GATED: tl.constexpr = False,
    ):
        """One bf16 row (decode), as `_int4_gemv_kernel` (outputs [BN*pid_n, +BN) x K steps of
        TILES tiles, GROUP % 128 == 0) with fewer instructions per weight (static SASS,
        bench/sass_int4.py):
        - two float slots per word: a nibble at bits 16-19 is 128 + u with one lop3, one at bits
          12-15 is 2048 + u (`_slot_float`), so the word itself, >> 8, << 8 and its halves
          swapped (`_rotate_16`) place all eight nibbles: 3 shifts per 8 weights, not 7;
        - x read as bf16 pairs (one 32-bit load for the K neighbours 2p and 2p + 1 of a slice,
          nibbles j and j + 4), each half widened to float32 by a shift or a mask;
        - the offsets come off per row and step: sum_j f_j x_j - A_p with A_p = sum_j (M_j + z)
          x_j (M_j the slot's 128 or 2048) - no per-tile sum of x across threads.
        The 2048 slot cancels ~8 bits of fp32's 24 within a step's 8 products (128: ~4), far
        below bf16's rounding of the output. EVEN_K and EVEN_N (whole steps, N % BN == 0): the
        weight and scale loads go unmasked. Static sm_90 SASS at the decode's shapes: 3.38
        instructions per weight in the main loop, against 4.59 (`_int4_gemv_kernel`) and 6.1
        (`_int4_mm_kernel`'s CUDA-core path); not yet timed on a GPU (docs/benchmarks.md,
        twenty-fifth session), so only a tuned entry or QFD_INT4_GEMV=two_slot selects it."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        R: tl.constexpr = 16 * TILES
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        offs_r = tl.arange(0, R)
        row_tile = offs_r // 16
        steps = tl.cdiv(KT, TILES)
        per_split = tl.cdiv(steps, SPLIT_K)
        s0 = pid_k * per_split
        s1 = tl.minimum(s0 + per_split, steps)
        acc = tl.zeros((R, BN), dtype=tl.float32)
        x_pairs = x_ptr.to(tl.pointer_type(tl.int32))  # x[2i], x[2i + 1] as one word i
        _prefetch_next(pf_ptr, pf_lines, PREFETCH, PF)
        for step in range(s0, s1):
            t_rows = step * TILES + row_tile
            r_mask = t_rows < KT
            tile_mask = r_mask[:, None] & n_mask[None, :]
            g_rows = t_rows * 128 // GROUP
            if EVEN_K and EVEN_N:  # whole steps, whole output blocks: no masks
                words = tl.load(q_ptr + (step * R + offs_r)[:, None] * N + offs_n[None, :])
                s_rows = tl.load(s_ptr + g_rows[:, None] * N + offs_n[None, :]).to(tl.float32)
            else:
                words = tl.load(q_ptr + (step * R + offs_r)[:, None] * N + offs_n[None, :], mask=tile_mask, other=0)
                s_rows = tl.load(s_ptr + g_rows[:, None] * N + offs_n[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            # x word of slice jj's pair for packed row p: (128 t + 32 jj + 2 p) / 2
            pair_at = t_rows * 64 + offs_r % 16
            x0l, x0h = _x_pair(x_pairs, pair_at, K, EVEN_K)
            x1l, x1h = _x_pair(x_pairs, pair_at + 16, K, EVEN_K)
            x2l, x2h = _x_pair(x_pairs, pair_at + 32, K, EVEN_K)
            x3l, x3h = _x_pair(x_pairs, pair_at + 48, K, EVEN_K)
            up = words << 8
            down = words >> 8
            swapped = _rotate_16(words, USE_ASM)
            x_128 = x0l + x2l + x0h + x2h  # the x of the nibbles read as 128 + u
            x_2048 = x1l + x3l + x1h + x3h  # and of those read as 2048 + u
            # the sum starts at minus the offsets, so every product is one FMA
            if HAS_ZEROS:
                z_rows = tl.load(z_ptr + g_rows[:, None] * N + offs_n[None, :], mask=tile_mask, other=0).to(tl.float32)
                part = -z_rows * (x_128 + x_2048)[:, None] - (128.0 * x_128 + 2048.0 * x_2048)[:, None]
            else:  # zero point 8
                part = tl.zeros((R, BN), dtype=tl.float32) - (136.0 * x_128 + 2056.0 * x_2048)[:, None]
            # nibble j (bits 4j..4j+3) with its x: j < 4 the pair's low half, j >= 4 its high half
            part += _slot_float(swapped, 16, USE_ASM) * x0l[:, None]  # j = 0
            part += _slot_float(up, 12, USE_ASM) * x1l[:, None]  # j = 1
            part += _slot_float(up, 16, USE_ASM) * x2l[:, None]  # j = 2
            part += _slot_float(words, 12, USE_ASM) * x3l[:, None]  # j = 3
            part += _slot_float(words, 16, USE_ASM) * x0h[:, None]  # j = 4
            part += _slot_float(down, 12, USE_ASM) * x1h[:, None]  # j = 5
            part += _slot_float(down, 16, USE_ASM) * x2h[:, None]  # j = 6
            part += _slot_float(swapped, 12, USE_ASM) * x3h[:, None]  # j = 7
            acc += part * s_rows
        out = tl.sum(acc, axis=0)
        row = tl.arange(0, 1)
        _write_out(out[None, :], row, offs_n, (row < 1)[:, None] & n_mask[None, :], n_mask, y_ptr, ws_ptr, cnt_ptr, b_ptr, N, 1, N,
                   pid_n, pid_k, SPLIT_K, HAS_BIAS, GATED)


# --------------------------------------------------------------------------- launchers

_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}  # bit pattern of MAGIC, MAGIC


def _pdl(cfg: KernelConfig, x: torch.Tensor) -> bool:
    wanted = configs.PDL_LAUNCH if cfg.pdl is None else cfg.pdl
    return wanted and x.is_cuda and not interpreting() and torch.cuda.get_device_capability(x.device)[0] >= 9


def _prefetch_args(prefetch: torch.Tensor | None, fallback: torch.Tensor, num_warps: int) -> dict:
    """The kernels' L2-prefetch arguments: `prefetch` (the next product's packed weights, see
    `Int4Linear.prefetch_next`) as 128-byte lines, one line per thread and instruction. Off
    under the interpreter (no PTX) and without a tensor (`fallback`: any pointer, never read)."""
    on = prefetch is not None and prefetch.is_cuda and not interpreting()
    lines = max(1, prefetch.numel() * prefetch.element_size() // 128) if on else 1
    return dict(pf_ptr=prefetch if on else fallback, pf_lines=lines, PREFETCH=on, PF=32 * num_warps)


def int4_matmul(x: torch.Tensor, packed: TritonInt4Weight, bias: torch.Tensor | None = None, config: KernelConfig | None = None,
                prefetch: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w_hat.T (+ bias), in x.dtype (bf16/fp16/fp32), fp32 accumulation.
    prefetch: the next product's packed weights, which the programs ask the L2 for as they start
    (QFD_INT4_PREFETCH; a hint, the result does not depend on it). gated: the weight's outputs
    interleave a gate and an up projection (`interleave_columns`); y [..., N / 2] is then
    silu(gate) * up, computed as the tile is stored (`silu_mul_interleaved` in torch)."""
    k, n = packed.in_features, packed.out_features
    if x.shape[-1] != k:
        raise ValueError(f"int4_matmul: x has {x.shape[-1]} features, the weight takes {k}")
    if gated and n % 2:
        raise ValueError(f"int4_matmul: a gated product needs an even number of outputs, got {n}")
    if not _HAVE_TRITON:
        raise RuntimeError("int4_matmul: triton is not installed (check available() first)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n_out = n // 2 if gated else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n_out)
    cfg = config or pick_config(m, n, k, x.device)
    if cfg.tiles and m == 1 and packed.group_size % TILE_K == 0:
        return _gemv(x2, packed, bias, cfg, y, prefetch, gated).reshape(*lead, n_out)
    bm = cfg.block_m if cfg.use_dot else 1
    grid_n = -(-n // cfg.block_n)
    grid_m = -(-m // bm)
    split = cfg.split_k
    if grid_n * grid_m > packed.counters.numel():
        split = 1
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y  # partials: all N
    # the two tensor-core kernels' common operands and specializations
    operands = (x2, packed.qweight, packed.scales, packed.zeros if packed.zeros is not None else packed.scales,
                bias if bias is not None else packed.scales, y, ws, packed.counters,
                m, n, k, packed.qweight.shape[0] // 16, x2.stride(0), y.stride(0))
    shared = dict(GROUP=packed.group_size, HAS_ZEROS=packed.zeros is not None, HAS_BIAS=bias is not None,
                  BM=bm, BN=cfg.block_n, SPLIT_K=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages, GATED=gated,
                  **_prefetch_args(prefetch, packed.qweight, cfg.num_warps))
    if cfg.use_dot and (configs.MMA16 if cfg.mma16 is None else cfg.mma16) and x.dtype in _MAGIC:
        magic_bits, magic_value = _MAGIC[x.dtype]
        _int4_mma_kernel[(grid_n, split, grid_m)](
            *operands, **shared, MAGIC_BITS=magic_bits, MAGIC=magic_value,
            EVEN_M=m % bm == 0, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % TILE_K == 0, USE_ASM=not interpreting(),
        )
        return y.reshape(*lead, n_out)
    magic = cfg.use_dot and (configs.MAGIC_DOT if cfg.magic is None else cfg.magic) and x.dtype in _MAGIC
    magic_bits, magic_value = _MAGIC[x.dtype] if magic else (0, 0.0)
    pdl = _pdl(cfg, x)
    w_first = cfg.use_dot and (configs.W_FIRST_DOT if cfg.w_first is None else cfg.w_first)
    _int4_mm_kernel[(grid_n, split, grid_m)](
        *operands, **shared, USE_DOT=cfg.use_dot, DOT_IEEE=x.dtype == torch.float32,
        MAGIC_BITS=magic_bits, MAGIC=magic_value, PDL=pdl, W_FIRST=w_first, EVEN_K=k % TILE_K == 0,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y.reshape(*lead, n_out)


def _gemv(x: torch.Tensor, packed: TritonInt4Weight, bias: torch.Tensor | None, cfg: KernelConfig, y: torch.Tensor,
          prefetch: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """One row into y [1, N] (gated: [1, N / 2]) through `_int4_gemv_two_slot_kernel` (cfg.two_slot
    and x readable as aligned bf16 pairs) or `_int4_gemv_kernel`."""
    n = packed.out_features
    kt = packed.qweight.shape[0] // 16
    grid_n = -(-n // cfg.block_n)
    split = min(cfg.split_k, -(-kt // cfg.tiles)) if grid_n <= packed.counters.numel() else 1
    ws = torch.empty(split, n, dtype=torch.float32, device=x.device) if split > 1 else y
    # the two kernels' common operands and specializations
    operands = (x, packed.qweight, packed.scales, packed.zeros if packed.zeros is not None else packed.scales,
                bias if bias is not None else packed.scales, y, ws, packed.counters, n, packed.in_features, kt)
    shared = dict(GROUP=packed.group_size, HAS_ZEROS=packed.zeros is not None, HAS_BIAS=bias is not None,
                  BN=cfg.block_n, TILES=cfg.tiles, SPLIT_K=split, USE_ASM=not interpreting(), GATED=gated,
                  EVEN_K=packed.in_features % TILE_K == 0 and kt % cfg.tiles == 0,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_prefetch_args(prefetch, packed.qweight, cfg.num_warps))
    if cfg.two_slot and x.dtype == torch.bfloat16 and packed.in_features % 2 == 0 and x.data_ptr() % 4 == 0:  # x read as bf16 pairs
        _int4_gemv_two_slot_kernel[(grid_n, split)](*operands, **shared, EVEN_N=n % cfg.block_n == 0)
        return y
    pdl = _pdl(cfg, x)
    _int4_gemv_kernel[(grid_n, split)](*operands, **shared, OFFSET_SUM=cfg.offset_sum, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return y


# --------------------------------------------------------------------------- torch op

@torch.library.custom_op("qfd::int4_mm", mutates_args=())
def int4_mm_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, counters: torch.Tensor,
               bias: torch.Tensor | None, group_size: int, in_features: int, prefetch: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """`int4_matmul` as an opaque torch op, so torch.compile keeps it as one call (a GEMM has
    nothing to fuse) instead of tracing into Triton's launcher. The split-K `counters` are
    written during the launch but always return to zero, so to every caller the op has no
    mutated input (declaring one would make functionalization copy the buffer per call).
    Without Triton, or on CPU tensors outside Triton's interpreter, it runs `reference_matmul`:
    same layout, float32 math."""
    packed = TritonInt4Weight(qweight, scales, zeros, counters, group_size, in_features, qweight.shape[1])
    if not runs_on(x):
        return reference_matmul(x, packed, bias, gated)
    return int4_matmul(x, packed, bias, prefetch=prefetch, gated=gated)


@int4_mm_op.register_fake
def _int4_mm_fake(x, qweight, scales, zeros, counters, bias, group_size, in_features, prefetch=None, gated=False):
    return x.new_empty(*x.shape[:-1], qweight.shape[1] // 2 if gated else qweight.shape[1])

