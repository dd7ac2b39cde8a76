"""Fixed-shape steps for CUDA graphs: the target's decode (T = 1) and verify (T = k + 1) forwards
over a static cache, and the drafter's block forward over a fixed-size context window.

At batch 1 a step of a small model is launch-bound (environment.md: 44-95 ms per eager
forward at Qwen3.5-4B shape, ~0.06 ms of bandwidth for the embedded model), so the speed
comes from replaying each step as one CUDA graph. A graph replays kernels on fixed buffers:
every input lives in a static tensor (token ids, positions), every shape is fixed, and nothing
may depend on a Python int that changes between steps. The target already has that piece
(`TargetModel.forward_at` over a `static=True` cache); the drafter's `draft()` slices its
context by position, so here it reads a fixed window of S context slots instead
(S = sliding window W, or the whole cache) through an index tensor, masking slots that do
not exist yet. With `use_graphs=False` (the CPU) the same fixed-shape code runs eagerly: tests
check on the CPU that it equals the dynamic path exactly.

With `compile=True` each fixed-shape step function (the target's `forward_at` per size, the
drafter's window block forward) is first wrapped in `torch.compile` (`compile_step`: one
whole graph, static shapes, inductor's default mode) and only then warmed up and captured: the
graph then replays inductor's fused kernels (RMSNorm, RoPE, SiLU*mul, residual adds) instead
of one kernel per eager op. Inductor's own CUDA graphs ("reduce-overhead") stay off: we
capture ourselves. Without graphs (the CPU) the compiled function runs as it is; either way
it compiles once per size, at construction (warm-up), never per step: every input is a static
buffer and nothing the step reads changes between calls.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from qfd.kernels import graphed_step
from qfd.models.drafter import rope_cos_sin, store_context_kv
from qfd.models.target import TargetOutput
from qfd.quant import int4_linear


def compile_step(fn: Callable, backend: str | Callable = "inductor") -> Callable:
    """`torch.compile` for a fixed-shape step that the caller captures in a CUDA graph itself:
    one graph (a graph break would be an error), no dynamic shapes (one compile per size), and
    mode "default" - not "reduce-overhead", whose CUDA graphs would clash with our capture.
    `backend`: "inductor" (fusion, what the GPU wants); tests use "aot_eager" (same capture
    and guards, no codegen) or a counting backend."""
    return torch.compile(fn, fullgraph=True, dynamic=False, mode="default", backend=backend)


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `fn` up on a side stream (allocator pools, cuBLAS handles, lazy init), then capture
    one call of it as a CUDA graph. Returns the graph and that call's output, whose tensors
    every replay refills."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode(), graphed_step():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode(), graphed_step():
        out = fn()
    return graph, out


class StaticTargetSteps:
    """Replays `model.forward_at` for fixed token counts (e.g. 1 and 16) over `cache`.

    Call it like the model: `steps(input_ids, cache, tap_layers=...)` with T in `sizes` uses
    the captured graph; anything else (the prefill) runs the model eagerly. Outputs of a replay
    live in static buffers that the next replay overwrites: consume them first.
    `compile`: torch.compile `forward_at` (see `compile_step`) before warm-up and capture."""

    def __init__(self, model, cache, sizes: Sequence[int] = (1, 16), tap_layers: Sequence[int] = (), use_graphs: bool | None = None, compile: bool = False, compile_backend: str | Callable = "inductor", tree_size: int = 0):
        if not cache.static:
            raise ValueError("StaticTargetSteps needs a cache made with static=True (fixed attention shapes)")
        self.model, self.cache, self.tap_layers = model, cache, tuple(tap_layers)
        device = model.model.embed_tokens.weight.device
        self.use_graphs = (device.type == "cuda") if use_graphs is None else use_graphs
        self.compiled = bool(compile)
        if int4_linear.PREFETCH_NEXT and device.type == "cuda":  # before the step is traced: the links are read then
            one = torch.zeros(1, 1, dtype=torch.long, device=device)
            int4_linear.link_prefetches(model, lambda: model.forward_at(one, cache, torch.zeros(1, dtype=torch.long, device=device), self.tap_layers))
            cache.reset()
        self.step_fn = compile_step(model.forward_at, compile_backend) if compile else model.forward_at
        self.steps: dict[int, dict] = {}
        for size in sizes:
            self.steps[size] = self._capture(size, device)
        # a tree verify of `tree_size` nodes (qfd.tree): its own step, with slots and ancestors
        self.tree_step = self._capture(tree_size, device, tree=True) if tree_size else None
        cache.reset()  # warm-up and capture wrote garbage state; masked KV is harmless

    def _capture(self, size: int, device, tree: bool = False) -> dict:
        ids = torch.zeros(1, size, dtype=torch.long, device=device)
        positions = torch.arange(size, device=device)
        base = torch.arange(size, device=device)
        step = {"ids": ids, "positions": positions, "base": base, "graph": None}
        extra = ()
        if tree:
            step["slots"] = torch.arange(size, device=device)
            step["ancestors"] = torch.ones(size, size, dtype=torch.bool, device=device).tril()
            extra = (False, step["slots"], step["ancestors"])
        run = lambda: self.step_fn(ids, self.cache, positions, self.tap_layers, *extra)  # noqa: E731
        step["run"] = run
        if not self.use_graphs:
            if self.compiled:
                with torch.inference_mode():  # compile now (as __call__ runs it), not in the first request
                    run()
            return step
        step["graph"], step["out"] = capture(run)
        # The GDN states keep Python references to tensors of their last forward (conv window,
        # prepared inputs); a replay refreshes the tensors' contents but runs no Python, so
        # re-point the states at the capture's tensors after every replay.
        step["gdn"] = {i: (s.window, s.inputs, s.steps, s.tree_conv, s.from_records) for i, s in self.cache.gdn.items()}
        return step

    def __call__(self, input_ids: torch.Tensor, cache=None, tap_layers: Sequence[int] = (), last_only: bool = False) -> TargetOutput:
        size = input_ids.shape[1]
        step = self.steps.get(size)
        if step is None or (cache is not None and cache is not self.cache) or tuple(tap_layers) != self.tap_layers or last_only:
            return self.model(input_ids, self.cache if cache is None else cache, tap_layers=tap_layers, last_only=last_only)
        start = self.cache.begin(size)
        step["ids"].copy_(input_ids)
        torch.add(step["base"], start, out=step["positions"])
        return self._run(step, size)

    def prefill(self, input_ids: torch.Tensor, chunk: int) -> TargetOutput:
        """The prompt's forward over this (empty or continued) cache as replays of a captured
        step of `chunk` tokens - the chain step of that size, else the tree step verifying a
        chain - the last chunk padded and cut back. Returns the last prompt position's logits
        [1, 1, V] and every position's taps; the cache then holds exactly the prompt.

        At batch 1 on a GPU an eager forward is launch-bound whatever its length (tens of ms:
        every op a kernel launch from Python), while a replay costs about one verify step, so
        a short prompt goes faster as a few replays (Engine: prompts up to
        GRAPHED_PREFILL_MAX_TOKENS). Same math as the eager prefill, in chunks."""
        step_size = chunk if chunk in self.steps else None
        if step_size is None and (self.tree_step is None or self.tree_step["ids"].shape[1] != chunk):
            raise ValueError(f"no captured step of {chunk} tokens to prefill with")
        device = input_ids.device
        if step_size is None:  # a chain as a tree: node i's parent is i - 1
            depths = torch.arange(chunk, device=device)
            ancestors = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
        total, taps, logits = input_ids.shape[1], [], None
        for lo in range(0, total, chunk):
            part = input_ids[:, lo : lo + chunk]
            n = part.shape[1]
            if n < chunk:  # padding rows: computed, then dropped by the cut below
                part = torch.cat([part, part[:, -1:].expand(1, chunk - n)], dim=1)
            start = self.cache.length
            if step_size is None:
                out = self.verify_tree(part, self.cache, depths, ancestors, self.tap_layers)
                self.cache.keep_tree_path(list(range(n)))
            else:
                out = self(part, self.cache, self.tap_layers)
                if n < chunk:
                    self.cache.rollback(start + n)
            if self.tap_layers:  # out lives in static buffers the next replay overwrites
                taps.append(out.taps[:, :n].clone())
            if lo + chunk >= total:
                logits = out.logits[:, n - 1 : n].clone()
        return TargetOutput(logits, torch.cat(taps, dim=1) if taps else None)

    def verify_tree(self, input_ids: torch.Tensor, cache, depths: torch.Tensor, ancestors: torch.Tensor, tap_layers: Sequence[int] = ()) -> TargetOutput:
        """`TargetModel.verify_tree` replayed: a tree of `tree_size` nodes over this cache."""
        step = self.tree_step
        size = input_ids.shape[1]
        if step is None or step["ids"].shape[1] != size or cache is not self.cache or tuple(tap_layers) != self.tap_layers:
            return self.model.verify_tree(input_ids, cache, depths, ancestors, tap_layers)
        start = self.cache.begin(size)
        step["ids"].copy_(input_ids)
        torch.add(depths.to(step["positions"].device), start, out=step["positions"])
        torch.add(step["base"], start, out=step["slots"])
        step["ancestors"].copy_(ancestors)
        return self._run(step, size)

    def _run(self, step: dict, size: int) -> TargetOutput:
        if step["graph"] is None:
            with torch.inference_mode():  # as at capture / compile: a compiled step is guarded on it
                out = step["run"]()
        else:
            step["graph"].replay()
            out = step["out"]
            for i, (window, inputs, steps, tree_conv, from_records) in step["gdn"].items():
                state = self.cache.gdn[i]
                state.window, state.inputs, state.steps, state.tree_conv, state.from_records = window, inputs, steps, tree_conv, from_records
        self.cache.end(size)
        return out


class StaticDraftStep:
    """`drafter.draft()` with fixed shapes: the block attends to S context slots gathered from
    the drafter cache (S = the sliding window, else the cache's whole length), padding slots
    masked. Same tokens as `drafter.draft` (checked on the CPU). `num_drafts` (default B-1)
    is fixed at capture: the block forward covers all B slots (or `block_len`, see
    drafter.draft), the LM head only the first k.
    A `head` with `vocab_ids` (qfd.draft_vocab.DraftVocabHead) is captured as it is: logits
    over its N ids, the argmax mapped back through them.
    `compile`: torch.compile the block forward (see `compile_step`) before warm-up and capture."""

    def __init__(self, drafter, cache, embed: Callable, head: Callable, use_graphs: bool | None = None, num_drafts: int | None = None, compile: bool = False, compile_backend: str | Callable = "inductor", block_len: int | None = None, top_k: int = 0):
        self.drafter, self.cache, self.embed, self.head = drafter, cache, embed, head
        cfg = drafter.cfg
        self.block_len, self.num_drafts = drafter.block_shape(block_len, num_drafts)  # slots run, drafts returned
        device = cache.k.device
        self.window = min(cfg.sliding_window or cache.max_len, cache.max_len)
        self.use_graphs = (device.type == "cuda") if use_graphs is None else use_graphs
        self.first = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.slots = torch.arange(self.window, device=device)
        self.block_offsets = torch.arange(self.block_len, device=device)
        self.top_k = int(top_k)  # > 0: return each slot's top-k ids and log-probs (tree drafts)
        self.graph = None
        self.compiled = bool(compile)
        self.step_fn = compile_step(self._forward, compile_backend) if compile else self._forward
        if self.use_graphs:
            self.graph, self.tokens = capture(self.step_fn)
        elif self.compiled:
            with torch.inference_mode():  # compile now, not in the first request (reads the cache only)
                self.step_fn()

    def _forward(self) -> torch.Tensor:
        d, cache = self.drafter, self.cache
        whole = self.window == cache.max_len  # the block sees the whole cache: slot j is position j
        if whole:  # no gather: every layer attends to its cache as it lies, positions >= start masked
            visible = self.slots < self.start
        else:  # a sliding window: context slot j holds position start - S + j; negative positions do not exist
            context_positions = self.start - self.window + self.slots
            visible = context_positions >= 0
            index = context_positions.clamp_min(0)
        mask = torch.cat([visible, torch.ones_like(self.block_offsets, dtype=torch.bool)]).expand(self.block_len, -1)
        h = d._block_inputs(self.first, self.embed, self.block_len)
        positions = (self.start + self.block_offsets).view(1, -1)
        rope = rope_cos_sin(positions, d.cfg.head_dim, d.cfg.rope_theta, h.dtype)  # once, not twice per layer
        for i, layer in enumerate(d.layers):
            k_ctx = cache.k[i] if whole else cache.k[i].index_select(2, index)
            v_ctx = cache.v[i] if whole else cache.v[i].index_select(2, index)
            h = layer(h, positions, k_ctx, v_ctx, mask, rope)
        hidden = d.norm(h[:, 1 : 1 + self.num_drafts])
        weight = getattr(self.head, "weight", None)
        logits = self.head(hidden.to(weight.dtype) if weight is not None else hidden)
        if self.top_k:
            return draft_candidates(logits, self.top_k, self.head)
        tokens = logits.argmax(-1)
        vocab_ids = getattr(self.head, "vocab_ids", None)  # a draft vocabulary (qfd.draft_vocab)
        return tokens if vocab_ids is None else self.head.to_vocab(tokens)

    @torch.inference_mode()
    def __call__(self, first_token: int, start_pos: int) -> torch.Tensor:
        """Draft tokens [1, num_drafts] for the block at `start_pos` (cache.length >= start_pos);
        with top_k, (ids, log-probs), each [1, num_drafts, top_k]."""
        if self.cache.length < start_pos:
            raise ValueError(f"draft at {start_pos}: the cache holds only {self.cache.length} context positions")
        self.first.fill_(int(first_token))
        self.start.fill_(int(start_pos))
        if self.graph is None:
            return self.step_fn()
        self.graph.replay()
        return self.tokens


def draft_candidates(logits: torch.Tensor, k: int, head: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits [..., V] (or over a draft vocabulary's N ids) -> the top-k vocabulary ids
    and their log-probabilities, best first: the candidates of a draft tree (qfd.tree)."""
    scores, index = logits.float().log_softmax(-1).topk(k, dim=-1)
    vocab_ids = getattr(head, "vocab_ids", None)
    return (index if vocab_ids is None else head.to_vocab(index)), scores


class StaticAppendStep:
    """`drafter.append_context` for the taps of one verify (at most `rows` = k + 1 of them),
    replayed as one CUDA graph.

    Eager, the append after every verify launches ~20 small kernels per drafter layer one by
    one from Python; at the embedded model's scale that launch time is a visible part of a
    speculative step. The graph always projects all `rows` tap rows, at positions start ..
    start + rows - 1, and the cache length then counts only the n committed ones: rows past it
    (stale taps) leave K/V at positions >= the length, which no draft reads (a draft at p reads
    positions < p) and the next append overwrites. Without room for `rows` positions (the end
    of the cache) it falls back to the eager append."""

    def __init__(self, drafter, cache, rows: int, use_graphs: bool | None = None, compile: bool = False, compile_backend: str | Callable = "inductor"):
        self.drafter, self.cache, self.rows = drafter, cache, int(rows)
        cfg = drafter.cfg
        device = cache.k.device
        self.use_graphs = (device.type == "cuda") if use_graphs is None else use_graphs
        width = len(cfg.target_layer_ids) * cfg.target_hidden_size
        self.taps = torch.zeros(1, self.rows, width, device=device, dtype=drafter.fc.weight.dtype)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.offsets = torch.arange(self.rows, device=device)
        self.graph = None
        # compiled: the projections' ~20 small kernels per layer (norms, RoPE) fused, which a
        # graph replays but still runs one by one (~0.4 ms an append at Qwen3.5-4B shape, H100).
        # The cache writes stay outside the compiled code: mutating the cache there made inductor
        # copy the whole cache per append (0.83 ms at an 8K context, docs/benchmarks.md 2026-12-06).
        self.project_fn = compile_step(self._project, compile_backend) if compile else self._project
        if self.use_graphs:  # warm-up and capture write positions 0.. of an empty cache: nothing valid yet
            self.graph, _ = capture(self._forward)

    def _project(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.drafter.context_kv(self.taps, self.start + self.offsets)

    def _forward(self) -> None:
        store_context_kv(self.cache, self.project_fn(), self.start + self.offsets)

    @torch.inference_mode()
    def __call__(self, taps: torch.Tensor, start_pos: int) -> None:
        """As `drafter.append_context(cache, taps, start_pos)`: afterwards cache.length ==
        start_pos + n for taps [1, n, width]."""
        n = taps.shape[1]
        if n > self.rows or start_pos > self.cache.length or start_pos + self.rows > self.cache.max_len:
            self.drafter.append_context(self.cache, taps, start_pos)
            return
        self.taps[:, :n].copy_(taps)
        self.start.fill_(int(start_pos))
        if self.graph is None:
            self._forward()
        else:
            self.graph.replay()
        self.cache.length = start_pos + n
