"""Stateful generation: target-only and speculative (DFlash) decoding, batch 1.

The loop (method.md section 4; DFlash, arXiv 2602.06036):

    prefill the prompt (target, with taps of the drafter's layers) -> first token
    drafter.append_context(prompt taps)
    each step, L = cache.length (committed tokens minus the last one, not yet fed):
        drafts = drafter.draft(ctx, last, L, num_drafts=k)    # k <= B-1 proposals, one forward
        out = target([last, *drafts], cache, taps)            # verify k+1 tokens, one forward
        verdict = verify(drafts, out.logits)                  # accepted n + bonus token
        cache.rollback(L + n + 1); drafter.append_context(out.taps[:, :n + 1], L)

Target-only decoding is the same loop with k = 0 (no drafts): one code path, so greedy
speculative output equals greedy target-only output token for token. Every step verifies
exactly k+1 tokens (static shapes for CUDA graphs); the end of the token budget truncates the
committed chunk instead of shrinking the block, which is why the caches hold max_len + B.

The draft length k (`draft_len`, default B-1) trades acceptance for step cost: the drafter's
block forward always covers its B slots (it was trained on full MASK blocks), but its LM head
covers only k slots and the target verifies k+1 tokens. On a GPU a 16-token verify costs about
a decode step, so k = B-1 is best. On a CPU a multi-token verify costs more than a decode step
and a step pays off only when tau_k > (draft_k + verify_k) / decode;
bench/bench_cpu_draft_len.py measures those costs per k.

A draft tree (`tree_size` = N, CLI --tree; qfd.tree) verifies N tokens per step laid out as a
tree of the drafter's best-scoring paths instead of one chain; the kept path's K/V are moved
into place and a Gated DeltaNet layer keeps the state of the path's last node.

A draft vocabulary (`draft_vocab` = N, CLI --draft-vocab; qfd.draft_vocab) computes the
drafter's logits over the N most frequent ids of its training data only, a cheaper LM head.
Output is unchanged: every committed token is the target's (greedy: its argmax; sampling:
the drafter's proposal is deterministic, q one-hot at the draft, so rejection sampling is
exact whatever the drafter proposes, in or out of the subset).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from qfd.errors import QfdError
from qfd.speculative import SamplingParams, sample, target_probs, verify

# Chunked prefill (Engine(chunked_prefill=...)): a prompt of up to GRAPHED_PREFILL_MAX_TOKENS
# runs as replays of a captured PREFILL_CHUNK-token step instead of one eager forward. Where
# the line lies (H200, batch 1, 2026-12-05 figures): an eager prompt forward is launch-bound,
# ~70-117 ms at Qwen3.5-4B shape for 64 tokens and still ~175-206 ms for 2048, against ~5.4 ms
# per graphed 16-token verify: chunks win up to ~20 of them. 256 tokens = 16 chunks of 16.
PREFILL_CHUNK = 16
GRAPHED_PREFILL_MAX_TOKENS = 256


class ContextLengthError(QfdError):
    """The prompt plus the requested tokens do not fit the engine's context."""


class Cancelled(Exception):
    """Raise from an on_tokens callback (or set `cancel`) to stop a generation early."""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: Sequence[str] = ()  # stop strings: the text ends before the first one
    eos_ids: Sequence[int] | None = None  # None: the engine's (tokenizer / generation_config)
    seed: int | None = None
    ignore_eos: bool = False  # exact output lengths (latency protocol)

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(s for s in (self.stop or ()) if s))
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        if self.max_new_tokens < 1:
            raise QfdError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise QfdError(f"temperature must be >= 0 (got {self.temperature}); 0 means greedy")
        if not 0 < self.top_p <= 1:
            raise QfdError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise QfdError(f"top_k must be >= 0 (got {self.top_k}); 0 disables it")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclass
class GenerationStats:
    """Per request. tau: committed tokens per verify step, bonus included (1 without a drafter);
    accept_per_position[i]: fraction of steps whose draft token i+1 was accepted (one entry per
    draft position, k = the engine's draft_len); block_size: tokens verified per step (k + 1)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # verify steps after the prefill
    tau: float = float("nan")
    accept_per_position: list[float] = field(default_factory=list)
    ttft_s: float = 0.0  # prefill + first token
    total_s: float = 0.0
    tokens_per_s: float = 0.0  # new tokens / total time
    decode_tokens_per_s: float = float("nan")  # after the first token
    block_size: int = 1  # tokens verified per step: draft_len + 1 (1 without a drafter)
    finish_reason: str = "length"  # stop | length | cancelled

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (a final EOS included; cut after the stop string)
    text: str | None  # detokenized, stop string removed (None without a tokenizer)
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


class Detokenizer:
    """Incremental decoding (vLLM-style prefix/read offsets): decodes a short window of recent
    tokens per chunk and holds back text ending in an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could start a stop string (not yet safe to emit)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


def default_eos_ids(tokenizer) -> tuple[int, ...]:
    """EOS ids of the tokenizer plus generation_config.json beside it (Qwen: two ids)."""
    ids: list[int] = []

    def add(value):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)

    if tokenizer is None:
        return ()
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
    if path.is_file():
        try:
            add(json.loads(path.read_text()).get("eos_token_id"))
        except (OSError, json.JSONDecodeError):
            pass
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)


def check_short_block_flag(short_block: bool, draft_len: int | None, drafter) -> None:
    """--short-block cuts the drafter's block to the draft_len + 1 slots verified: it needs a
    drafter, and without a --draft-len it would be the whole block, a flag that does nothing."""
    if short_block and not drafter:
        raise QfdError("--short-block needs a drafter (--drafter) and --draft-len")
    if short_block and draft_len is None:
        raise QfdError("--short-block needs --draft-len k (it runs the drafter's block over the k + 1 slots verified)")


def check_draft_len(draft_len: int | None, block_size: int | None) -> int:
    """The draft length k to use: `draft_len` (None: B-1, the whole block) checked against the
    drafter's block size B (None: no drafter, k = 0). A user error is one QfdError line."""
    if block_size is None:
        if draft_len is not None:
            raise QfdError("--draft-len needs a drafter (--drafter); target-only decoding drafts nothing")
        return 0
    if draft_len is None:
        return block_size - 1
    if not 1 <= draft_len <= block_size - 1:
        raise QfdError(f"--draft-len must be in 1..{block_size - 1} for this drafter (block size {block_size}); got {draft_len}")
    return int(draft_len)


def check_tree_flag(tree: int, drafter) -> None:
    """--tree N, checked before any model loads (and again by the Engine)."""
    if tree and not drafter:
        raise QfdError("--tree needs a drafter (--drafter); target-only decoding drafts nothing")
    if tree < 0 or tree == 1:
        raise QfdError(f"--tree must be 0 (a chain) or at least 2 tokens (the last token and one draft); got {tree}")


def check_speculation_flags(drafter, draft_len: int | str | None, short_block: bool, tree: int, draft_vocab: int | None) -> None:
    """The drafter options `generate`, `serve` and `eval` share, checked before any model loads:
    each needs a drafter, and each value must make sense on its own (the drafter's own limits,
    its block size and draft vocabulary, are checked once it is known)."""
    from qfd.draft_vocab import check_draft_vocab_flag

    if draft_len is not None and not drafter:
        raise QfdError("--draft-len needs a drafter (--drafter); target-only decoding drafts nothing")
    if isinstance(draft_len, int) and draft_len < 1:
        raise QfdError(f"--draft-len must be >= 1 (got {draft_len})")
    check_short_block_flag(short_block, draft_len, drafter)
    check_tree_flag(tree, drafter)
    check_draft_vocab_flag(draft_vocab, drafter)


def check_tree(tree_size: int | None, tree_width: int, drafter) -> tuple[int, int]:
    """(N, W) for tree verification, or (0, W) for a chain; a user error is one QfdError line."""
    n = int(tree_size or 0)
    check_tree_flag(n, drafter)
    if n and not 1 <= tree_width <= 64:
        raise QfdError(f"--tree-width must be in 1..64; got {tree_width}")
    return n, int(tree_width)


class Engine:
    """One target (+ optional DFlash drafter) with preallocated caches; `generate` serves one
    request at a time (a lock serialises callers)."""

    def __init__(self, target, tokenizer=None, drafter=None, max_len: int | None = None, eos_ids: Sequence[int] | None = None, static_cache: bool = False, cuda_graphs: bool | None = None, draft_len: int | None = None, compile_steps: bool = False, compile_backend: str | Callable = "inductor", draft_vocab: int | None = None, short_block: bool = False, tree_size: int = 0, tree_width: int = 8, chunked_prefill: bool | None = None, prefetch_draft: bool | None = None):
        from qfd.draft_vocab import draft_head_for

        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.max_len = int(max_len or target.config.max_position_embeddings)
        self.block_size = drafter.block_size if drafter is not None else 1  # the drafter's B
        # drafts verified per step (k); 0 without a drafter. verify_len = k + 1 tokens per step.
        self.draft_len = check_draft_len(draft_len, self.block_size if drafter is not None else None)
        self.verify_len = self.draft_len + 1
        # tree_size N > 0: verify a tree of N tokens per step instead of a chain of k + 1
        # (qfd.tree): the best-scoring paths over each draft slot's top `tree_width` tokens.
        self.tree_size, self.tree_width = check_tree(tree_size, tree_width, drafter)
        if self.tree_size:
            # a tree of N nodes is at most N - 1 drafts deep: the drafter's LM head need not
            # score the slots below that
            self.draft_len = min(self.draft_len, self.tree_size - 1)
        # short_block: the drafter runs only the k + 1 block slots whose drafts are verified
        # (drafter.draft's block_len), not all B - cheaper, but not the function it was trained
        # as; None: the whole block.
        self.short_block = bool(short_block) and drafter is not None
        self.draft_block_len = self.draft_len + 1 if self.short_block else None
        if self.tree_size:
            self.verify_len = self.tree_size
        # The drafter's LM head: the target's, or with draft_vocab = N its rows of the N most
        # frequent ids of the drafter's training data (qfd.draft_vocab; load_drafter attaches
        # the counts), a contiguous copy made here once.
        self.draft_vocab = draft_vocab
        vocab_head = draft_head_for(target, drafter, draft_vocab)
        self.draft_head = target.head if vocab_head is None else vocab_head
        self.tap_layers = tuple(drafter.cfg.target_layer_ids) if drafter is not None else ()
        self.device = target.model.embed_tokens.weight.device
        self.eos_ids = tuple(eos_ids) if eos_ids is not None else default_eos_ids(tokenizer)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        # chunked_prefill (default: with CUDA graphs on a GPU): prompts of up to
        # GRAPHED_PREFILL_MAX_TOKENS run as replays of a captured step of prefill_chunk tokens
        # (StaticTargetSteps.prefill) - the tree step when it is that big, else a chain step.
        if chunked_prefill is None:
            chunked_prefill = bool(cuda_graphs) and self.device.type == "cuda"
        self.prefill_chunk = 0
        if chunked_prefill and (cuda_graphs or compile_steps):
            self.prefill_chunk = self.tree_size if self.tree_size >= PREFILL_CHUNK else max(PREFILL_CHUNK, self.verify_len)
        room = max(self.block_size, self.verify_len, self.prefill_chunk)  # a padded last chunk too
        # + room: the last verify of a budget (block_size, or the tree's N) may run past max_len
        # (its tail is discarded), and so may a padded last prefill chunk (cut back after).
        # max_verify stays >= 16 whatever k is: prompts up to 16 tokens then take the same GDN
        # kernel (recurrent, not chunked) as in a target-only engine, so prefills match exactly.
        self.cache = target.new_cache(self.max_len + room, max_verify=max(16, self.verify_len), static=static_cache)
        self.draft_cache = drafter.new_cache(self.max_len + self.block_size) if drafter is not None else None
        # The step functions: with cuda_graphs (default: on a CUDA device) the fixed-size verify
        # (and decode) forwards, the drafter's block forward and its context append replay
        # captured CUDA graphs - at batch 1 a GPU step is launch-bound (H200, Qwen3.5-4B shape: an
        # eager forward ~50 ms, the graphed decode 8.8 ms; docs/benchmarks.md);
        # cuda_graphs=True on the CPU runs the same fixed-shape code eagerly (tests). Otherwise
        # eager. compile_steps implies that static path and
        # torch.compiles each step function first (qfd.models.graphs.compile_step; CLI --compile):
        # on CUDA the graphs then replay inductor's fused kernels. compile_backend: "inductor",
        # or e.g. "aot_eager" (tests: the same graph capture without code generation).
        self.forward = target
        self.draft_step = None
        self.append_step = None  # with CUDA graphs: the drafter's context append as one graph
        self.compile_steps = bool(compile_steps)
        self.cuda_graphs = bool(cuda_graphs)
        if cuda_graphs or compile_steps:
            from qfd.models.graphs import StaticAppendStep, StaticDraftStep, StaticTargetSteps

            if not self.cache.static:
                self.cache = target.new_cache(self.max_len + room, max_verify=max(16, self.verify_len), static=True)
            compile_args = dict(compile=self.compile_steps, compile_backend=compile_backend)
            chain_sizes = {1} if self.tree_size else {1, self.verify_len}
            if self.prefill_chunk and self.prefill_chunk != self.tree_size:
                chain_sizes.add(self.prefill_chunk)
            self.forward = StaticTargetSteps(target, self.cache, sizes=sorted(chain_sizes), tap_layers=self.tap_layers, tree_size=self.tree_size, **compile_args)
            if drafter is not None:
                top_k = self.tree_width if self.tree_size else 0
                self.draft_step = StaticDraftStep(drafter, self.draft_cache, embed=target.embed, head=self.draft_head, num_drafts=self.draft_len, block_len=self.draft_block_len, top_k=top_k, **compile_args)
                if self.draft_step.use_graphs:  # the CPU keeps the eager append: it projects only the n rows
                    self.append_step = StaticAppendStep(drafter, self.draft_cache, rows=self.draft_len + 1, **compile_args)
        # prefetch_draft (with a graphed drafter on a GPU): a step ends by launching the next
        # step's draft, so the GPU drafts while the host commits the step's tokens (detokenise,
        # stops, stream) instead of waiting for it; the next step takes that draft when it is
        # for the same (last token, position). A generation that ends there wastes one draft.
        if prefetch_draft is None:
            prefetch_draft = self.draft_step is not None and self.device.type == "cuda"
        self.prefetch_draft = bool(prefetch_draft) and drafter is not None
        self._pinned: torch.Tensor | None = None  # host buffer of the tree drafts' one copy
        self._lock = threading.Lock()
        self.on_step: Callable[[dict], None] | None = None  # test hook: called after every rollback

    # --- convenience for the harness / server -------------------------------------------------
    def encode(self, prompt: str | Sequence[dict], chat: bool | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a raw prompt (str) or of chat messages (list of {role, content}) through
        the tokenizer's chat template with the assistant header appended."""
        if self.tokenizer is None:
            raise QfdError("this engine has no tokenizer; pass token ids to generate()")
        if isinstance(prompt, str) and not chat:
            return list(self.tokenizer(prompt)["input_ids"])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not getattr(self.tokenizer, "chat_template", None):
            raise QfdError("chat messages need a tokenizer with a chat template; this model has none")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {}))
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def generate_text(self, prompt: str | Sequence[dict], config: GenerationConfig | None = None, chat: bool | None = None, **kwargs) -> GenerationResult:
        """generate() over a raw prompt or chat messages (see `encode`)."""
        return self.generate(self.encode(prompt, chat), config or GenerationConfig(), **kwargs)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1:
            raise ContextLengthError("the prompt is empty; give at least one token")
        if prompt_len + max_new_tokens > self.max_len:
            raise ContextLengthError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} exceeds the context of {self.max_len} tokens")

    # --- the loop -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None, on_tokens: Callable[[list[int], str], None] | None = None, cancel: Callable[[], bool] | None = None) -> GenerationResult:
        """Generate from `prompt_ids`. `on_tokens(ids, text)` gets every committed chunk and the
        text that became final with it ("" while held back by a possible stop string or a split
        character); raise `Cancelled` from it, or make `cancel()` true, to stop early."""
        config = config or GenerationConfig()
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_fits(len(prompt_ids), config.max_new_tokens)
        if config.stop and self.tokenizer is None:
            raise QfdError("stop strings need a tokenizer; this engine has none")
        with self._lock:
            return _Run(self, prompt_ids, config, on_tokens, cancel).run()


class _Run:
    """State of one generate() call."""

    def __init__(self, engine: Engine, prompt_ids: list[int], config: GenerationConfig, on_tokens, cancel):
        self.e, self.prompt, self.cfg, self.on_tokens, self.cancel = engine, prompt_ids, config, on_tokens, cancel
        self.params = config.sampling
        self.eos = set() if config.ignore_eos else set(config.eos_ids if config.eos_ids is not None else engine.eos_ids)
        self.tokens: list[int] = []
        self.detok = Detokenizer(engine.tokenizer) if engine.tokenizer is not None else None
        self.text = ""  # decoded so far (stop string cut away once found)
        self.emitted = 0  # characters of self.text already given to on_tokens
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), block_size=engine.verify_len)
        self.accepted_counts = [0] * engine.draft_len
        self.prefetched: tuple | None = None  # (last token, position, draft) launched ahead
        self.prefetch_hits = 0
        self.generator = torch.Generator(device=engine.device)
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()

    def run(self) -> GenerationResult:
        e = self.e
        sync = torch.cuda.synchronize if e.device.type == "cuda" else (lambda: None)
        start = time.perf_counter()
        e.cache.reset()
        if e.draft_cache is not None:
            e.draft_cache.rollback(0)
        ids = torch.tensor([self.prompt], device=e.device)
        if e.prefill_chunk and len(self.prompt) <= GRAPHED_PREFILL_MAX_TOKENS:
            out = e.forward.prefill(ids, e.prefill_chunk)
        else:
            out = e.forward(ids, e.cache, tap_layers=e.tap_layers, last_only=True)
        first = int(sample(target_probs(out.logits[0, -1], self.params), self.generator)) if not self.params.greedy else int(out.logits[0, -1].argmax())
        if e.drafter is not None:
            e.drafter.append_context(e.draft_cache, out.taps, 0)
        sync()
        self.stats.ttft_s = time.perf_counter() - start
        finish = self.commit([first])
        taus = []
        while finish is None:
            if self.cancel is not None and self.cancel():
                finish = "cancelled"
                break
            accepted, chunk = self.step()
            taus.append(accepted + 1)
            finish = self.commit(chunk)
        sync()
        self.stats.total_s = time.perf_counter() - start
        return self.finish(finish, taus)

    def step(self) -> tuple[int, list[int]]:
        """One draft + verify step; returns (accepted drafts, committed tokens)."""
        e = self.e
        if e.tree_size:
            return self.tree_step()
        L, last = e.cache.length, self.tokens[-1]
        block = torch.tensor([[last]], device=e.device)
        drafts = block[0, 1:]
        if e.drafter is not None:
            drafts = self.drafted(last, L)
            block = torch.cat([block, drafts.view(1, -1).to(block.dtype)], dim=1)
        out = e.forward(block, e.cache, tap_layers=e.tap_layers)
        verdict = verify(drafts, out.logits[0], self.params, None, self.generator)
        n = verdict.accepted
        e.cache.rollback(L + n + 1)
        return self.after_verify(n, verdict.tokens, out.taps[:, : n + 1] if e.drafter is not None else None, L)

    def launch_draft(self, last: int, start: int):
        """The drafter's block after token `last` at position `start`, launched: a chain's
        drafts [k] on the device; a tree's candidate ids and scores as one float32 [k, 2w]
        copy to the host, under way (host tensor, CUDA event or None)."""
        e = self.e
        if not e.tree_size:
            if e.draft_step is not None:
                return e.draft_step(last, start)[0]
            return e.drafter.draft(e.draft_cache, last, start, embed=e.target.embed, head=e.draft_head, num_drafts=e.draft_len, block_len=e.draft_block_len)[0]
        from qfd.models.graphs import draft_candidates

        if e.draft_step is not None:
            candidates, scores = e.draft_step(last, start)
        else:
            _, logits = e.drafter.draft(e.draft_cache, last, start, embed=e.target.embed, head=e.draft_head, return_logits=True, num_drafts=e.draft_len, block_len=e.draft_block_len)
            candidates, scores = draft_candidates(logits, e.tree_width, None)
        # one device-to-host copy (ids < 2**24 are exact in float32): the step's only wait before the tree
        both = torch.cat([candidates[0].float(), scores[0].float()], dim=-1)
        if not both.is_cuda:
            return both, None
        if e._pinned is None or e._pinned.shape != both.shape:
            e._pinned = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        e._pinned.copy_(both, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return e._pinned, done

    def drafted(self, last: int, start: int):
        """`launch_draft(last, start)`'s result: the one the previous step launched ahead when
        it is for this token and position, else launched now."""
        ahead, self.prefetched = self.prefetched, None
        if ahead is not None and ahead[:2] == (last, start):
            self.prefetch_hits += 1
            return ahead[2]
        return self.launch_draft(last, start)

    def after_verify(self, n: int, tokens: list[int], taps: torch.Tensor | None, start: int) -> tuple[int, list[int]]:
        """After a verify kept n drafts: the drafter's context gets the committed tokens' taps
        (from position `start`), the stats count the step. Returns (n, committed tokens)."""
        e = self.e
        if taps is not None:
            if e.append_step is not None:
                e.append_step(taps, start)
            else:
                e.drafter.append_context(e.draft_cache, taps, start)
        self.stats.steps += 1
        for k in range(n):
            self.accepted_counts[k] += 1
        if e.on_step is not None:
            e.on_step({"committed": self.prompt + self.tokens + tokens[:-1], "cache": e.cache, "draft_cache": e.draft_cache, "accepted": n})
        if e.prefetch_draft and e.drafter is not None:  # the next step's draft, while the host commits this one
            self.prefetched = (tokens[-1], e.cache.length, self.launch_draft(tokens[-1], e.cache.length))
        return n, tokens

    def tree_step(self) -> tuple[int, list[int]]:
        """As `step`, verifying a draft tree (qfd.tree) instead of a chain."""
        from qfd.tree import build_tree, pad_tree, tree_inputs, walk_greedy, walk_sampling

        e = self.e
        L, last = e.cache.length, self.tokens[-1]
        both, done = self.drafted(last, L)
        if done is not None:
            done.synchronize()
        both = both.cpu().clone()  # the pinned buffer is the next launch's
        width = both.shape[-1] // 2
        tree = pad_tree(build_tree(last, both[:, :width].long(), both[:, width:], e.tree_size), e.tree_size)
        ids, depths, ancestors = tree_inputs(tree, e.device)
        out = e.forward.verify_tree(ids, e.cache, depths, ancestors, e.tap_layers)
        if self.params.greedy:
            verdict = walk_greedy(tree, out.logits[0].argmax(-1).tolist())
        else:
            verdict = walk_sampling(tree, target_probs(out.logits[0], self.params), self.generator)
        e.cache.keep_tree_path(verdict.path)
        taps = out.taps[:, torch.tensor(verdict.path, device=out.taps.device)]
        return self.after_verify(verdict.accepted, verdict.tokens, taps, L)

    def commit(self, chunk: list[int]) -> str | None:
        """Apply budget, EOS and stop strings to a committed chunk; stream it; the finish reason
        when the generation ends here."""
        finish = None
        room = self.cfg.max_new_tokens - len(self.tokens)
        if len(chunk) >= room:
            chunk, finish = chunk[:room], "length"
        for i, token in enumerate(chunk):
            if token in self.eos:
                chunk, finish = chunk[: i + 1], "stop"
                break
        before = len(self.tokens)
        self.tokens.extend(chunk)
        if self.detok is not None:
            self.text += self.detok.add(chunk)
            cut = self.find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                self.tokens = self.tokens[: self.tokens_covering(before)]
                chunk, finish = self.tokens[before:], "stop"
        if self.on_tokens is not None:
            safe = len(self.text) if finish is not None else len(self.text) - held_back(self.text, self.cfg.stop)
            delta = self.text[self.emitted : max(safe, self.emitted)]
            self.emitted = max(safe, self.emitted)
            try:
                self.on_tokens(list(chunk), delta)
            except Cancelled:
                return "cancelled"
        return finish

    def find_stop(self) -> int | None:
        """Index in self.text where the first stop string starts, or None."""
        if not self.cfg.stop:
            return None
        window = max(len(s) for s in self.cfg.stop)
        lo = max(0, self.emitted - window)  # emitted text never contained a stop
        hits = [i for s in self.cfg.stop if (i := self.text.find(s, lo)) >= 0]
        return min(hits) if hits else None

    def tokens_covering(self, before: int) -> int:
        """Fewest tokens (more than `before`) whose text contains a stop string: the tokens
        after the stop are dropped. (Earlier chunks held no stop: each chunk is checked.)"""
        for n in range(before + 1, len(self.tokens) + 1):
            text = self.e.tokenizer.decode(self.tokens[:n], skip_special_tokens=True)
            if any(stop in text for stop in self.cfg.stop):
                return n
        return len(self.tokens)

    def finish(self, reason: str, taus: list[int]) -> GenerationResult:
        s = self.stats
        s.finish_reason = reason
        s.new_tokens = len(self.tokens)
        s.tau = sum(taus) / len(taus) if taus else float("nan")
        s.accept_per_position = [c / s.steps for c in self.accepted_counts] if s.steps else [0.0] * len(self.accepted_counts)
        s.tokens_per_s = s.new_tokens / s.total_s if s.total_s > 0 else float("nan")
        rest = s.total_s - s.ttft_s
        s.decode_tokens_per_s = (s.new_tokens - 1) / rest if s.new_tokens > 1 and rest > 0 else float("nan")
        text = self.text if self.detok is not None else None
        return GenerationResult(tokens=self.tokens, text=text, stats=s, prompt_ids=self.prompt)
