"""Every Gated DeltaNet layer's rollback in one kernel launch.

After a verify keeps `keep` of its T tokens, each GDN layer restores its recurrent state and its
conv state (K-1 columns of the forward's conv window). Done per layer - two eager copies each,
48 launches at Qwen3.5-4B shape between graph replays - that costs what the CPU needs to launch
them: 0.214 ms on the H200 (seventeenth session's ledger, 4.4% of a speculative step) for ~50 MB
of copying, ~15 us of HBM time. Here one program grid covers all layers: each layer's buffers
are read from a table of addresses (int64 `data_ptr`s, one row per layer), so one launch
restores every layer whatever buffers a step captured.

The recurrent state comes from one of:
- the saved start (keep = 0) or a history slot (the state after the last kept token), a bit copy;
- the forward's token records (`qfd.models.gdn.delta_rule`'s k, delta, decay per token and head,
  written instead of the history by `gated_delta_conv_step`): the start with the first `keep`
  updates replayed, `fma(k, delta, state * decay)` per element as the step kernel rounds them
  (`gdn_triton._apply_update`), so the result is the state the step computed, bit for bit
  under Triton's interpreter and, on the H100, at Qwen3.5-4B's layer shape
  (`bench/bench_gdn_step.py --record states,records`). At a small bf16 test shape (dk 32, dv 48)
  ~5% of the elements come out one float32 ulp apart on the GPU. Not pinned down: the kernel's
  TTGIR computes the recorded k and delta a second time, in another layout than the copies the
  update uses (the same ops), so the code generated for the two copies is the suspect.
The conv state is a bit copy of window columns (ints of the element's width).

A tree verify keeps one node's path the same way: the state from that node's history slot, the
conv columns gathered by the node's window indices (`qfd.models.gdn.tree_structure`).
"""

from __future__ import annotations

import torch

from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, tl, triton  # noqa: F401 (tl: the kernel)

STATE_BLOCK = 4096  # float32 elements of recurrent state per program copied (16 KB)
REPLAY_BLOCK = 1024  # ... per program replayed from records (a [8, 128] tile at dv = 128)

if _HAVE_TRITON:
    # A table row: where one layer's buffers live (element addresses, B = 1; RECORDS 0 if none).
    RECURRENT, START, HISTORY, CONV, WINDOW, RECORDS, COLUMNS = (tl.constexpr(i) for i in range(7))

    @triton.jit
    def _restore_kernel(table, columns, history_offset, first_column, replayed, state_numel, conv_rows, win_c, win_w, H,
                        DK: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, KM1: tl.constexpr, KM1_P2: tl.constexpr,
                        CONV_BITS: tl.constexpr, SOURCE: tl.constexpr, GATHER: tl.constexpr, WITH_CONV: tl.constexpr,
                        BLOCK: tl.constexpr, STATE_ROWS: tl.constexpr, ROWS: tl.constexpr):
        """Program (layer, chunk): a block of the layer's [H, DK, DV] recurrent state - SOURCE 0:
        BLOCK elements from `start`; 1: from the history `history_offset` elements in; 2:
        STATE_ROWS rows (of H * DK) from `start` with the first `replayed` token records
        applied - and (WITH_CONV) ROWS rows of its conv state from the window: columns
        first_column + j, or columns[j] (GATHER)."""
        layer, chunk = tl.program_id(0), tl.program_id(1)
        row = table + layer * COLUMNS
        if SOURCE == 2:
            _replay_records(row, chunk, replayed, H, DK, DV, DVP, STATE_ROWS)
        else:
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            inside = offs < state_numel
            if SOURCE == 0:
                src = tl.load(row + START).to(tl.pointer_type(tl.int32))
            else:
                src = tl.load(row + HISTORY).to(tl.pointer_type(tl.int32)) + history_offset
            dst = tl.load(row + RECURRENT).to(tl.pointer_type(tl.int32))
            tl.store(dst + offs, tl.load(src + offs, mask=inside), mask=inside)
        if WITH_CONV:
            _restore_conv(row, columns, first_column, conv_rows, win_c, win_w, chunk, KM1, KM1_P2, CONV_BITS, GATHER, ROWS)

    @triton.jit
    def _replay_records(row, chunk, replayed, H, DK: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr, STATE_ROWS: tl.constexpr):
        """STATE_ROWS rows (block `chunk` of the H * DK rows) of the recurrent state: the start
        with the first `replayed` token records' updates, in the step kernel's rounding."""
        rows = chunk * STATE_ROWS + tl.arange(0, STATE_ROWS)
        cols = tl.arange(0, DVP)
        head, i = rows // DK, rows % DK
        row_in = rows < H * DK
        mask = row_in[:, None] & (cols < DV)[None, :]
        tile = rows[:, None] * DV + cols[None, :]
        state = tl.load(tl.load(row + START).to(tl.pointer_type(tl.float32)) + tile, mask=mask, other=0.0)
        records = tl.load(row + RECORDS).to(tl.pointer_type(tl.float32))
        for t in range(replayed):
            rec = records + (t * H + head) * (DK + DV + 1)  # [STATE_ROWS] this token's record of each row's head
            decay = tl.load(rec + DK + DV, mask=row_in, other=0.0)
            k = tl.load(rec + i, mask=row_in, other=0.0)
            delta = tl.load(rec[:, None] + DK + cols[None, :], mask=mask, other=0.0)
            state = tl.fma(k[:, None], delta, state * decay[:, None])  # gdn_triton._apply_update's rounding
        tl.store(tl.load(row + RECURRENT).to(tl.pointer_type(tl.float32)) + tile, state, mask=mask)

    @triton.jit
    def _restore_conv(row, columns, first_column, conv_rows, win_c, win_w, chunk,
                      KM1: tl.constexpr, KM1_P2: tl.constexpr, CONV_BITS: tl.constexpr, GATHER: tl.constexpr, ROWS: tl.constexpr):
        """ROWS rows (block `chunk`) of a layer's conv state [C, KM1] from its window [C, K-1+T]
        (element (c, w) at c win_c + w win_w): columns first_column + j, or columns[j] (GATHER);
        a bit copy."""
        conv_type = tl.int16 if CONV_BITS == 16 else tl.int32
        conv = tl.load(row + CONV).to(tl.pointer_type(conv_type))
        window = tl.load(row + WINDOW).to(tl.pointer_type(conv_type))
        rows = chunk * ROWS + tl.arange(0, ROWS)
        j = tl.arange(0, KM1_P2)
        if GATHER:
            cols = tl.load(columns + j, mask=j < KM1, other=0)
        else:
            cols = first_column + j
        mask = (rows[:, None] < conv_rows) & (j[None, :] < KM1)
        values = tl.load(window + rows[:, None].to(tl.int64) * win_c + cols[None, :].to(tl.int64) * win_w, mask=mask)
        tl.store(conv + rows[:, None] * KM1 + j[None, :], values, mask=mask)


def address_table(states) -> torch.Tensor:
    """[layers, 6] int64 addresses of each GDNState's recurrent, start, history, conv, window (of
    its last forward) and token records (0 without), on the states' device."""
    rows = [[s.recurrent.data_ptr(), s.start.data_ptr(), s.history.data_ptr(), s.conv.data_ptr(), s.window.data_ptr(),
             0 if s.records is None else s.records.data_ptr()] for s in states]
    return torch.tensor(rows, dtype=torch.int64, device=states[0].recurrent.device)


def restore(table: torch.Tensor, state, slot: int = -1, first_column: int = 0, columns: torch.Tensor | None = None, replayed: int | None = None) -> None:
    """Restore every layer in `table` (all shaped like GDNState `state`, batch 1): the recurrent
    state from history slot `slot` (-1: the saved start), or with `replayed` = n from the start
    and the first n token records; the conv state from window columns `first_column` + j (or
    `columns` [K-1], int64, on the device). Every layer's window has `state.window`'s strides."""
    _launch(table, state.recurrent.shape, state.conv, state.window.stride()[1:], slot, first_column, columns, replayed)


def replay(out: torch.Tensor, start: torch.Tensor, records: torch.Tensor, replayed: int) -> None:
    """One layer's state after the first `replayed` recorded tokens into `out` [1, H, dk, dv]:
    `start` with their updates from `records` [1, >=replayed, H, dk + dv + 1], rounded as the
    step kernel rounded them (conv state untouched)."""
    table = torch.tensor([[out.data_ptr(), start.data_ptr(), 0, 0, 0, records.data_ptr()]], dtype=torch.int64, device=out.device)
    _launch(table, out.shape, None, (0, 0), -1, 0, None, replayed)


def _launch(table, state_shape, conv: torch.Tensor | None, window_strides: tuple[int, int], slot: int, first_column: int, columns: torch.Tensor | None, replayed: int | None) -> None:
    """`_restore_kernel` over the table's layers; conv None: the recurrent state only."""
    layers = table.shape[0]
    _, heads, dk, dv = state_shape
    state_numel = heads * dk * dv
    conv_rows, km1 = (conv.shape[1], conv.shape[2]) if conv is not None else (0, 1)
    source = 2 if replayed else 0 if slot < 0 else 1
    dvp = triton.next_power_of_2(dv)
    state_rows = max(1, REPLAY_BLOCK // dvp)
    chunks = triton.cdiv(heads * dk, state_rows) if source == 2 else triton.cdiv(state_numel, STATE_BLOCK)
    rows_per_chunk = triton.next_power_of_2(max(1, triton.cdiv(conv_rows, chunks)))
    chunks = max(chunks, triton.cdiv(conv_rows, rows_per_chunk))
    _restore_kernel[(layers, chunks)](
        table, table if columns is None else columns, max(slot, 0) * state_numel, first_column, replayed or 0, state_numel, conv_rows,
        *window_strides, heads,
        DK=dk, DV=dv, DVP=dvp, KM1=km1, KM1_P2=triton.next_power_of_2(km1), CONV_BITS=16 if conv is None else conv.element_size() * 8,
        SOURCE=source, GATHER=columns is not None, WITH_CONV=conv is not None, BLOCK=STATE_BLOCK, STATE_ROWS=state_rows, ROWS=rows_per_chunk,
        num_warps=4,
    )
