"""Every Gated DeltaNet layer's rollback in one kernel launch.

After a verify keeps `keep` of its T tokens, each GDN layer restores its recurrent state (the
saved start, or the history slot of its last kept token) and its conv state (K-1 columns of the
forward's conv window): two copies per layer, 48 at Qwen3.5-4B shape. Run eagerly between graph
replays they cost what the CPU needs to launch them: 0.214 ms on the H200 (seventeenth session's
ledger, 4.4% of a speculative step) for ~50 MB of copying, ~15 us of HBM time. Here one program
grid covers all layers: each layer's five buffers are read from a table of addresses (int64
`data_ptr`s, one row per layer), so one launch restores every layer whatever buffers a step
captured. The copies are bit copies (ints of the element's width): no dtype conversion.

A tree verify keeps one node's path the same way: the state from that node's history slot, the
conv columns gathered by the node's window indices (`qfd.models.gdn.tree_structure`).
"""

from __future__ import annotations

import torch

from qfd.kernels import HAVE_TRITON as _HAVE_TRITON, tl, triton  # noqa: F401 (tl: the kernel)

# A table row: where one layer's buffers live (element addresses, B = 1).
RECURRENT, START, HISTORY, CONV, WINDOW = range(5)
STATE_BLOCK = 4096  # float32 elements of recurrent state per program (16 KB)

if _HAVE_TRITON:

    @triton.jit
    def _restore_kernel(table, columns, history_offset, first_column, state_numel, conv_rows, window_cols,
                        KM1: tl.constexpr, KM1_P2: tl.constexpr, CONV_BITS: tl.constexpr, FROM_START: tl.constexpr,
                        GATHER: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """Program (layer, chunk): BLOCK elements of the layer's recurrent state from `start`
        (FROM_START) or the history `history_offset` elements in, and ROWS rows of its conv state
        from the window: columns first_column + j, or columns[j] (GATHER)."""
        layer, chunk = tl.program_id(0), tl.program_id(1)
        row = table + layer * 5
        if FROM_START:
            src = tl.load(row + START).to(tl.pointer_type(tl.int32))
        else:
            src = tl.load(row + HISTORY).to(tl.pointer_type(tl.int32)) + history_offset
        dst = tl.load(row + RECURRENT).to(tl.pointer_type(tl.int32))
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = offs < state_numel
        tl.store(dst + offs, tl.load(src + offs, mask=inside), mask=inside)

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
        values = tl.load(window + rows[:, None].to(tl.int64) * window_cols + cols[None, :], mask=mask)
        tl.store(conv + rows[:, None] * KM1 + j[None, :], values, mask=mask)


def address_table(states) -> torch.Tensor:
    """[layers, 5] int64 addresses of each GDNState's recurrent, start, history, conv and window
    (the window of its last forward), on the states' device."""
    rows = [[s.recurrent.data_ptr(), s.start.data_ptr(), s.history.data_ptr(), s.conv.data_ptr(), s.window.data_ptr()] for s in states]
    return torch.tensor(rows, dtype=torch.int64, device=states[0].recurrent.device)


def restore(table: torch.Tensor, state, slot: int, first_column: int = 0, columns: torch.Tensor | None = None) -> None:
    """Restore every layer in `table` (all shaped like GDNState `state`, batch 1): recurrent
    state from history slot `slot` (-1: the saved start), conv state from window columns
    `first_column` + j (or `columns` [K-1], int64, on the device)."""
    layers = table.shape[0]
    state_numel = state.recurrent.numel()
    conv_rows, km1 = state.conv.shape[1], state.conv.shape[2]
    chunks = triton.cdiv(state_numel, STATE_BLOCK)
    rows_per_chunk = triton.next_power_of_2(triton.cdiv(conv_rows, chunks))
    chunks = max(chunks, triton.cdiv(conv_rows, rows_per_chunk))
    _restore_kernel[(layers, chunks)](
        table, table if columns is None else columns, max(slot, 0) * state_numel, first_column, state_numel, conv_rows, state.window.shape[-1],
        KM1=km1, KM1_P2=triton.next_power_of_2(km1), CONV_BITS=state.conv.element_size() * 8, FROM_START=slot < 0,
        GATHER=columns is not None,
        BLOCK=STATE_BLOCK, ROWS=rows_per_chunk, num_warps=4,
    )
