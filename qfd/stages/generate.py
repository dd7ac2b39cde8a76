"""`qfd generate`: target-only decoding with the runtime model, streamed to the terminal.

The pieces are reusable: `encode_prompt` (chat template or raw), `sample_next` (greedy /
temperature / top-k / top-p), `decode` (prefill + 1-token steps over a static cache, with a
per-chunk `on_tokens` callback) and `TextStream` (incremental detokenisation). qfd.engine
builds speculative decoding on the same model API; when it is installed, `run` goes through
it (so `--drafter` can plug in there), else through `decode`.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from qfd.errors import QfdError


@dataclass(frozen=True)
class GenerateConfig:
    target: str
    prompt: str
    chat: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    drafter: str | None = None  # DFlash drafter directory: speculative decoding through qfd.engine
    allow_target_mismatch: bool = False
    draft_len: int | str | None = None  # drafts verified per step (None: the drafter's B-1; "auto": measured, qfd.draft_len_auto)
    draft_vocab: int | None = None  # drafter LM head over the N most frequent ids (None: all; qfd.draft_vocab)
    short_block: bool = False  # the drafter runs only the draft_len + 1 verified block slots (Engine(short_block))
    tree: int = 0  # > 0: verify a draft tree of that many tokens per step (Engine(tree_size), qfd.tree)
    compile_steps: bool = False  # torch.compile the fixed-shape steps (implies them; CUDA graphs on CUDA)
    int4_head: bool = False  # RTN INT4 LM head at load (load_target(int4_head), qfd.quant.head)
    int8_head: bool = False  # RTN INT8 LM head at load (load_target(int8_head), qfd.quant.head.Int8Head)


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids (a final stop token included)
    prompt_tokens: int
    ttft_s: float  # prefill + first token
    total_s: float
    stopped: bool  # ended at a stop token (not at max_new_tokens)
    text: str = ""
    tau: float | None = None  # speculative only: committed tokens per verify step
    accept_per_position: list[float] | None = None

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token (what a user watching the stream sees)."""
        rest = self.total_s - self.ttft_s
        return (len(self.tokens) - 1) / rest if len(self.tokens) > 1 and rest > 0 else float("nan")

    @property
    def stats(self) -> dict[str, Any]:
        return {"new_tokens": len(self.tokens), "prompt_tokens": self.prompt_tokens, "tokens_per_s": self.tokens_per_s, "ttft_s": self.ttft_s, "total_s": self.total_s}


def check_config(cfg: GenerateConfig) -> None:
    if not cfg.prompt:
        raise QfdError("--prompt is empty; give the text to continue or answer")
    if cfg.max_new_tokens < 1:
        raise QfdError(f"--max-new-tokens must be >= 1 (got {cfg.max_new_tokens})")
    if cfg.temperature < 0:
        raise QfdError(f"--temperature must be >= 0 (got {cfg.temperature}); 0 means greedy")
    if not 0 < cfg.top_p <= 1:
        raise QfdError(f"--top-p must be in (0, 1] (got {cfg.top_p})")
    if cfg.top_k < 0:
        raise QfdError(f"--top-k must be >= 0 (got {cfg.top_k}); 0 disables it")
    from qfd.engine import check_speculation_flags

    check_speculation_flags(cfg.drafter, cfg.draft_len, cfg.short_block, cfg.tree, cfg.draft_vocab)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of `prompt`: through the chat template (one user turn + the assistant header)
    with `chat`, else the raw text (with the tokenizer's BOS if it adds one)."""
    if not chat:
        return list(tokenizer(prompt).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise QfdError("--chat needs a tokenizer with a chat template; this model has none (drop --chat)")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
        ids = ids["input_ids"]
    return list(ids)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next ids [B]. temperature 0: argmax; else softmax(logits / T) after
    keeping the top_k largest and the smallest set with probability mass >= top_p."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass BEFORE it already reaches top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def decode(model, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] = (), seed: int | None = None, on_tokens: Callable[[list[int]], None] | None = None, cache=None, step: Callable | None = None) -> DecodeResult:
    """Target-only decoding, batch 1: prefill the prompt, then one token per forward until a
    stop id or `max_new_tokens`. `on_tokens` gets each committed chunk (here: one token).
    `cache`: reuse a preallocated cache (reset here). `step`: a replacement for
    `model.forward_at` for the 1-token steps, e.g. its torch.compile'd version over a static
    cache (bench/bench_generate.py --compile)."""
    device = model.model.embed_tokens.weight.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if cache is None:
        cache = model.new_cache(len(prompt_ids) + max_new_tokens)
    else:
        cache.reset()
    stop = set(stop_ids)
    tokens: list[int] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    ids = torch.tensor([list(prompt_ids)], device=device)
    ttft = 0.0
    for index in range(max_new_tokens):
        if index == 0 or step is None:
            logits = model(ids, cache, last_only=True).logits[:, -1]
        else:
            position = cache.begin(1)
            logits = step(ids, cache, torch.tensor([position], device=device), (), True).logits[:, -1]
            cache.end(1)
        token = int(sample_next(logits, temperature, top_k, top_p, generator)[0])
        if index == 0:
            sync()
            ttft = time.perf_counter() - start
        tokens.append(token)
        if on_tokens is not None:
            on_tokens([token])
        if token in stop:
            break
        ids = torch.tensor([[token]], device=device)
    sync()
    return DecodeResult(tokens=tokens, prompt_tokens=len(prompt_ids), ttft_s=ttft, total_s=time.perf_counter() - start, stopped=bool(tokens) and tokens[-1] in stop)


class TextStream:
    """Incremental detokenisation: decode everything so far and emit only the new suffix, held
    back while it ends in an incomplete UTF-8 sequence (byte-level BPE splits characters)."""

    def __init__(self, tokenizer, write: Callable[[str], None]):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.emitted = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        if len(text) > self.emitted:
            self.write(text[self.emitted :])
            self.emitted = len(text)

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def run(cfg: GenerateConfig, write: Callable[[str], None] | None = None) -> DecodeResult:
    """Resolve -> load -> stream the answer through `write` (default: stdout). Nothing is written to disk."""
    import sys

    from qfd.checkpoint import resolve_model
    from qfd.device import pick_device, pick_dtype
    from qfd.models.loading import load_target, stop_token_ids, target_config

    check_config(cfg)
    model_dir = resolve_model(cfg.target)  # bad inputs fail here, before any loading
    target_config(model_dir)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    drafter = None
    if cfg.drafter:  # checked against the target before the long load
        from qfd.draft_len_auto import check_draft_len_or_auto
        from qfd.models.drafter import load_drafter, read_drafter_config, verify_drafter_target

        verify_drafter_target(cfg.drafter, model_dir.path, allow_mismatch=cfg.allow_target_mismatch)
        check_draft_len_or_auto(cfg.draft_len, Path(cfg.drafter), read_drafter_config(cfg.drafter).block_size)  # before the long load
        from qfd.draft_vocab import check_draft_vocab

        check_draft_vocab(Path(cfg.drafter), cfg.draft_vocab)
    model, tokenizer = load_target(model_dir, device, dtype, int4_head=cfg.int4_head, int8_head=cfg.int8_head)
    if cfg.drafter:
        drafter = load_drafter(cfg.drafter, device, dtype, fuse=True)
    if tokenizer is None:
        raise QfdError(f"{model_dir.path} has no tokenizer files; copy the tokenizer (tokenizer.json, tokenizer_config.json) into it")
    prompt_ids = encode_prompt(tokenizer, cfg.prompt, cfg.chat)
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + cfg.max_new_tokens > limit:
        raise QfdError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {cfg.max_new_tokens} exceeds the model's {limit} positions")
    if write is None:

        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

    stop_ids = stop_token_ids(model_dir, tokenizer)
    if drafter is not None or cfg.compile_steps or importlib.util.find_spec("qfd.engine") is not None:
        return _run_engine(model, tokenizer, prompt_ids, cfg, stop_ids, write, drafter)
    stream = TextStream(tokenizer, write)
    result = decode(model, prompt_ids, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, stop_ids=stop_ids, seed=cfg.seed, on_tokens=stream)
    result.text = stream.text
    return result


def _run_engine(model, tokenizer, prompt_ids, cfg: GenerateConfig, stop_ids, write, drafter=None) -> DecodeResult:
    """The same generation through qfd.engine (where speculative decoding lives)."""
    from qfd.engine import Engine, GenerationConfig

    if cfg.compile_steps:
        from qfd.console import console

        console.print("[dim]compiling the fixed-shape steps (torch.compile; the first start is slow)[/dim]", highlight=False)
    draft_len = cfg.draft_len
    if drafter is not None:
        from qfd.draft_len_auto import resolve_draft_len

        draft_len = resolve_draft_len(draft_len, model, tokenizer, drafter, Path(cfg.drafter), prompt_ids, draft_vocab=cfg.draft_vocab, short_block=cfg.short_block)
    engine = Engine(model, tokenizer, drafter=drafter, max_len=len(prompt_ids) + cfg.max_new_tokens, eos_ids=stop_ids, draft_len=draft_len, compile_steps=cfg.compile_steps, draft_vocab=cfg.draft_vocab, short_block=cfg.short_block, tree_size=cfg.tree)
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
    result = engine.generate(prompt_ids, gen, on_tokens=lambda ids, text: write(text) if text else None)
    stats = result.stats
    return DecodeResult(tokens=list(result.tokens), prompt_tokens=len(prompt_ids), ttft_s=stats.ttft_s, total_s=stats.total_s, stopped=stats.finish_reason == "stop", text=result.text or "",
                        tau=stats.tau if drafter is not None else None, accept_per_position=stats.accept_per_position if drafter is not None else None)
