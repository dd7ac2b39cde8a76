"""The runtime target's cache: a static KV cache for attention layers and the Gated DeltaNet
conv + recurrent state for linear-attention layers, with exact rollback.

Static shapes (gpt-fast style): every K/V buffer is preallocated as [B, kv_heads, max_len,
head_dim] and written in place at the token positions, so a decode or verify step has the same
shapes every time and CUDA graphs / torch.compile can capture it.

Rollback (speculative decoding keeps only the accepted prefix of a verified block):
- attention layers: free, the cache only sets `length` (stale K/V beyond it are masked, then
  overwritten by the next forward);
- Gated DeltaNet layers absorbed the rejected tokens into their state, so each multi-token
  forward records what restoring needs (method.md section 4): the conv window of the forward
  (the state after position j is a slice of it, no copy) and, for forwards of at most
  `max_verify` tokens (decode, verify), the recurrent state after EVERY position, written into
  a preallocated history buffer. Longer forwards (prefill) use the chunked kernel and keep the
  state at their start plus their prepared q/k/v/g/beta; rolling back into one recomputes the
  accepted part with the recurrent kernel.
  Memory: history = B * max_verify * num_v_heads * dk * dv * 4 bytes per GDN layer; for
  Qwen3.5-4B (24 GDN layers, 32 heads of 128x128) and max_verify 16 that is 768 MiB, on top of
  the 48 MiB of live recurrent state.
- a draft tree's forward (qfd.tree, TargetModel.verify_tree) writes node i's K/V at slot
  start + i and each node's GDN state into the history (max_verify >= the tree's size);
  `keep_tree_path` then moves the kept path's K/V into place and keeps its last node's state.
- with RECORD_UPDATES a decode / verify through the conv-step kernel records each token's
  update (k, delta, decay) instead of its state; a rollback replays the kept tokens' updates
  from the start, rounded as the step rounded them.
Where Triton runs, one kernel restores every GDN layer (ONE_LAUNCH_ROLLBACK,
`qfd.kernels.gdn_rollback_triton`): between graph replays, launches are what a rollback costs.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from qfd.kernels import gdn_rollback_triton, gdn_triton, kernel_failures, launch_or_fallback, runs_on
from qfd.models.gdn import chunked_gated_delta, recurrent_gated_delta, replay_update, tree_gated_delta

# Decode / verify steps through the fused Triton kernel where it runs (CUDA); False = the torch
# recurrence everywhere (bench_steps.py --reference-kernels flips it for a side-by-side run).
FUSED_STEP = True
# ... and with the conv, SiLU, q/k normalisation and gates folded into that kernel too (one
# kernel per layer instead of ~9 between the projections; bench_steps.py --no-fused-conv).
FUSED_CONV = True
# Roll every Gated DeltaNet layer back (or keep a tree node) in one Triton launch where it runs
# (`gdn_rollback_triton`) instead of two eager copies per layer (48 launches at Qwen3.5-4B shape);
# QFD_GDN_ROLLBACK=per_layer keeps the copies (bench/gpu_kernels_ab.sh variant rollback_per_layer).
ONE_LAUNCH_ROLLBACK = os.environ.get("QFD_GDN_ROLLBACK", "one_launch") != "per_layer"
# A decode / verify through the conv-step kernel records each token's update (k, delta, decay:
# dk + dv + 1 floats per head) instead of the state after it (dk x dv): 0.5 MB instead of 32 MB
# written per layer by a 16-token verify at Qwen3.5-4B shape (768 MB a step over 24 layers, ~1.3 ms
# of an A10G's bandwidth); a rollback replays the kept tokens' updates from the saved start
# (`gdn_rollback_triton`; bit-exact at Qwen3.5-4B's layer shape on the H100, within one float32 ulp
# at small bf16 test shapes). QFD_GDN_HISTORY=records turns it on: opt-in, as it measured 1.01x on
# a 16-token INT4 verify and no gain on verify + rollback (H100, twentieth session).
RECORD_UPDATES = os.environ.get("QFD_GDN_HISTORY", "states") == "records"


class GDNState:
    """Conv state [B, conv_dim, K-1] (model dtype) and recurrent state [B, H, dk, dv] (float32)
    of one Gated DeltaNet layer, plus the record of its last forward for rollback."""

    def __init__(self, batch: int, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, max_verify: int, dtype, device):
        self.conv = torch.zeros(batch, conv_dim, kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device)
        self.start = torch.zeros_like(self.recurrent)  # state before the last forward
        self.history = torch.zeros(batch, max_verify, heads, dk, dv, dtype=torch.float32, device=device)
        # RECORD_UPDATES: per-token records [k | delta | decay] of a conv-step forward (gdn.delta_rule)
        self.records = torch.zeros(batch, max_verify, heads, dk + dv + 1, dtype=torch.float32, device=device) if RECORD_UPDATES else None
        self.from_records = False  # whether the last forward wrote records instead of the history
        self.max_verify = max_verify
        self.window: torch.Tensor | None = None  # [B, C, K-1+T] of the last forward
        # keep -> (q, k, v, g, beta) of the first `keep` tokens of a long last forward
        self.inputs: Callable[[int], tuple] | None = None
        self.tree_conv: torch.Tensor | None = None  # [N, K] window columns per node of a tree forward
        self.steps = 0  # T of the last forward

    def advance(self, window, q, k, v, g, beta) -> torch.Tensor:
        """Run the gated delta rule over T new tokens from the current state, update the state
        in place and record what rollback needs. Returns the core output [B, T, H, dv] float32."""
        T = q.shape[1]
        if T <= self.max_verify and FUSED_STEP and runs_on(q):
            # one kernel: saves `start`, writes the history and the final state in place
            out = gdn_triton.gated_delta_step(q, k, v, g, beta, self.recurrent, self.start, self.history)
            self.conv.copy_(window[..., window.shape[-1] - self.conv.shape[-1] :])
            self.window, self.steps, self.inputs, self.tree_conv, self.from_records = window, T, None, None, False
            return out
        if T <= self.max_verify:  # the history holds every position's state
            out, final = recurrent_gated_delta(q, k, v, g, beta, self.recurrent, history=self.history)
            self.record_forward(window, final, None)
            return out
        out, final = chunked_gated_delta(q, k, v, g, beta, self.recurrent)
        self.record_forward(window, final, lambda keep: tuple(x[:, :keep] for x in (q, k, v, g, beta)))
        return out

    def record_forward(self, window, final, inputs_for) -> None:
        """After a forward computed outside the state (the torch forms, flash-linear-attention):
        `final` becomes the state, the window's tail the conv state. `inputs_for(keep)` gives the
        first `keep` tokens' (q, k, v, g, beta) should a rollback need them (None: the history
        holds every position's state)."""
        self.start.copy_(self.recurrent)
        self.recurrent.copy_(final)
        self.conv.copy_(window[..., window.shape[-1] - self.conv.shape[-1] :])
        self.window, self.steps, self.inputs, self.tree_conv = window, window.shape[-1] - self.conv.shape[-1], inputs_for, None
        self.from_records = False

    def takes_window(self, window: torch.Tensor) -> bool:
        """Whether `advance_window` runs here: a decode / verify (T <= max_verify) on a device
        where the fused kernel runs."""
        T = window.shape[-1] - self.conv.shape[-1]
        return T <= self.max_verify and FUSED_STEP and FUSED_CONV and runs_on(window)

    def advance_window(self, window, conv_weight, a, b, A_log, dt_bias, k_heads: int) -> torch.Tensor:
        """`advance` from the raw conv window and a/b projections (`qfd.models.gdn.conv_and_gates`
        inside the kernel): one kernel also updates the conv state. Returns [B, T, H, dv] float32."""
        self.window, self.steps, self.inputs, self.tree_conv = window, window.shape[-1] - self.conv.shape[-1], None, None
        self.from_records = self.records is not None
        record = self.records if self.from_records else self.history
        return gdn_triton.gated_delta_conv_step(window, conv_weight, a, b, A_log, dt_bias, self.recurrent, self.start, record, self.conv, k_heads)

    def advance_tree(self, window, conv_index, q, k, v, g, beta, parents) -> torch.Tensor:
        """Run the gated delta rule over the N nodes of a draft tree from the current state
        (`gdn_triton.gated_delta_tree_step` where Triton runs, else `tree_gated_delta`),
        recording every node's state in the history.
        The state itself moves only at `keep_tree_node`. Returns [B, N, H, dv] float32."""
        if q.shape[1] > self.max_verify:
            raise ValueError(f"a tree of {q.shape[1]} nodes needs a cache made with max_verify >= {q.shape[1]}")
        self.window, self.steps, self.inputs, self.tree_conv, self.from_records = window, q.shape[1], None, conv_index, False
        self.start.copy_(self.recurrent)
        if FUSED_STEP and runs_on(q):  # one kernel per layer (torch's loop where it fails)
            return gdn_triton.gated_delta_tree_step(q, k, v, g, beta, self.recurrent, self.history, parents)
        return tree_gated_delta(q, k, v, g, beta, self.recurrent, parents, self.history)

    def keep_tree_node(self, node: int) -> None:
        """After a tree forward: the state after tree node `node` (its path committed)."""
        self.recurrent.copy_(self.history[:, node])
        self.conv.copy_(self.window[..., self.tree_conv[node, 1:]])
        self.tree_node_kept()

    def tree_node_kept(self) -> None:
        """Forget the tree forward once a node's state and conv columns are restored."""
        self.steps, self.window, self.tree_conv = 0, None, None

    def rollback(self, keep: int) -> None:
        """Restore the state after the first `keep` tokens of the last forward (0 <= keep <= T)."""
        if keep == self.steps or self.window is None:
            return
        kernel_minus_1 = self.conv.shape[-1]
        self.conv.copy_(self.window[..., keep : keep + kernel_minus_1])
        if keep == 0:
            self.recurrent.copy_(self.start)
        elif self.from_records:
            self._replayed(keep, out=self.recurrent)
        elif self.inputs is None:
            self.recurrent.copy_(self.history[:, keep - 1])
        else:
            q, k, v, g, beta = self.inputs(keep)
            _, state = recurrent_gated_delta(q, k, v, g, beta, self.start)
            self.recurrent.copy_(state)

    def _replayed(self, keep: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The state after the first `keep` recorded tokens, written into `out` (a new tensor
        without): the start with their updates replayed, rounded as the code that recorded them
        did - the conv-step kernel's records in `gdn_rollback_triton` (its fused multiply-add),
        torch reference's in torch."""
        out = torch.empty_like(self.recurrent) if out is None else out
        if self.records_from_kernel() and self.recurrent.shape[0] == 1:
            if launch_or_fallback("Gated DeltaNet rollback (all layers)", lambda: gdn_rollback_triton.replay(out, self.start, self.records, keep) or True, lambda: False):
                return out
        state = self.start
        for t in range(keep):
            state = replay_update(state, self.records[:, t])
        return out.copy_(state)

    def records_from_kernel(self) -> bool:
        """Whether the last forward's records came from the conv-step kernel (not its torch fallback)."""
        return self.from_records and runs_on(self.recurrent) and "gated_delta_conv_step" not in kernel_failures()


class TargetCache:
    """Per-layer caches of a TargetModel. `k[i]`, `v[i]`: [B, kv_heads, max_len, head_dim] for
    attention layers; `gdn[i]`: GDNState for linear-attention layers. `length`: tokens held."""

    def __init__(self, k: dict[int, torch.Tensor], v: dict[int, torch.Tensor], gdn: dict[int, GDNState], max_len: int, static: bool = False, kv: torch.Tensor | None = None, max_verify: int = 16):
        self.k, self.v, self.gdn = k, v, gdn
        self.kv = kv  # [2, attention layers, B, kv_heads, max_len, hd]: k and v are views of it
        self.max_len = max_len
        self.max_verify = max_verify  # the most tokens of a step (decode, verify, tree, prefill chunk)
        # static: attention always spans the whole buffer under a position mask (fixed shapes
        # for CUDA graphs); otherwise it spans only the filled prefix (faster in eager mode).
        self.static = static
        self.length = 0
        self._last_start = 0  # length before the last forward
        self._address_tables: dict[tuple, torch.Tensor] = {}  # for _restore_in_one_launch

    def begin(self, steps: int) -> int:
        """Reserve `steps` positions for a forward; returns its first position."""
        if self.length + steps > self.max_len:
            raise ValueError(f"cache full: {self.length} + {steps} tokens > max_len {self.max_len}")
        self._last_start = self.length
        return self.length

    def end(self, steps: int) -> None:
        self.length += steps

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value [B, kv_heads, T, hd] at `positions` [T]; returns the buffers
        to attend over: the whole buffer (static) or the filled prefix including these tokens."""
        k_buf, v_buf = self.k[layer], self.v[layer]
        k_buf.index_copy_(2, positions, key.to(k_buf.dtype))
        v_buf.index_copy_(2, positions, value.to(v_buf.dtype))
        if self.static:
            return k_buf, v_buf
        end = self._last_start + key.shape[2]
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def prompt_start(self, steps: int) -> int | None:
        """For a forward of more tokens than any step takes - a prompt's, always eager, never
        captured - the first position it writes (a Python int); None for a step."""
        return self._last_start if steps > self.max_verify else None

    def key_count(self, steps: int) -> int:
        """How many key slots a forward of `steps` tokens attends over (what write_kv returns)."""
        return self.max_len if self.static else self._last_start + steps

    def rollback(self, n: int) -> None:
        """Keep the first n tokens. n must lie within the last forward: length before it <= n <= length."""
        if not self._last_start <= n <= self.length:
            raise ValueError(f"rollback({n}) outside the last forward (positions {self._last_start}..{self.length})")
        keep = n - self._last_start
        states = list(self.gdn.values())
        one_launch = bool(states) and keep != states[0].steps and self._restore_in_one_launch(
            states, keep - 1, first_column=keep, replayed=keep if states[0].from_records else None)
        if not one_launch:
            for state in states:
                state.rollback(keep)
        self.length = n

    def _restore_in_one_launch(self, states: list[GDNState], slot: int, first_column: int = 0, columns: torch.Tensor | None = None, replayed: int | None = None) -> bool:
        """Every GDN layer's recurrent state from history slot `slot` (-1: its start) - or from
        its start and the first `replayed` token records - and conv state from its window's
        columns (`first_column` + j, or `columns`), in one kernel launch (`gdn_rollback_triton`).
        False where that does not apply - the per-layer rollback then does the same - : not on a
        Triton device, batch > 1, a forward whose states are neither all in the history nor all
        in kernel-written records (a prompt's, which recomputes)."""
        first = states[0]
        window = first.window
        if not (ONE_LAUNCH_ROLLBACK and window is not None and runs_on(first.recurrent) and first.recurrent.shape[0] == 1
                and first.conv.element_size() in (2, 4) and window.dtype == first.conv.dtype):
            return False
        if any(s.inputs is not None or s.window is None or s.steps != first.steps or s.window.shape != window.shape or s.window.stride() != window.stride()
               or s.from_records != first.from_records for s in states) or (first.from_records and not first.records_from_kernel()):
            return False
        # the table of buffer addresses: one per set of windows (a graphed step reuses its own)
        key = tuple(s.window.data_ptr() for s in states)
        table = self._address_tables.get(key)
        if table is None:
            if len(self._address_tables) > 8:  # eager forwards: a new window every step
                self._address_tables.clear()
            table = self._address_tables[key] = gdn_rollback_triton.address_table(states)
        return launch_or_fallback("Gated DeltaNet rollback (all layers)", lambda: gdn_rollback_triton.restore(table, first, slot, first_column, columns, replayed) or True, lambda: False)

    def keep_tree_path(self, path: list[int]) -> None:
        """After a tree verify (qfd.tree): keep the tokens of tree nodes `path` (root first,
        relative to the forward's first slot) as the sequence continuing the cache. Their K/V
        move down to consecutive slots; a node's slot is never below its depth, so the gather
        reads every source before any write can reach it. Gated DeltaNet layers keep the
        state of the path's last node."""
        if self.kv is None:
            raise ValueError("a tree path can be kept only in a cache from TargetModel.new_cache")
        start, n = self._last_start, len(path)
        if not 1 <= n <= self.length - start:
            raise ValueError(f"tree path of {n} nodes outside the last forward ({self.length - start} tokens)")
        if list(path) != list(range(n)) and self.k:
            # every layer's K and V at once (views of self.kv): two kernels on a GPU
            src = torch.tensor(path, device=self.kv.device) + start
            self.kv[..., start : start + n, :] = self.kv.index_select(-2, src)
        states = list(self.gdn.values())
        node = path[-1]
        if states and states[0].tree_conv is not None and self._restore_in_one_launch(states, node, columns=states[0].tree_conv[node, 1:]):
            for state in states:
                state.tree_node_kept()
        else:
            for state in states:
                state.keep_tree_node(node)
        self.length = start + n

    def reset(self) -> None:
        """Empty the cache for a new sequence (buffers are reused; GDN states zeroed)."""
        self.length = self._last_start = 0
        for state in self.gdn.values():
            state.conv.zero_()
            state.recurrent.zero_()
            state.window = state.inputs = state.tree_conv = None
            state.from_records = False
            state.steps = 0
