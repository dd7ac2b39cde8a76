"""The DFlash block-diffusion drafter (method.md section 2; DFlash, arXiv 2602.06036).

A few Qwen3-style decoder layers with no embedding or LM head of their own: the target's
frozen embedding and head are passed in as callables. Tapped target hidden states (k layers,
concatenated, k*H) are fused by `fc` (k*H -> H) + `hidden_norm` into one context feature per
context token; every layer projects that feature with its OWN k/v projections (k-norm, RoPE at
the context token's true position) and prepends it to the block's keys/values. Queries come
only from the block [last committed token, MASK x (B-1)], which is non-causal: one forward
gives B-1 draft tokens.

Parameter names follow vLLM's DFlash loader (vllm/model_executor/models/qwen3_dflash.py) and
z-lab's reference model: `layers.{i}.self_attn.{q,k,v,o}_proj`, `...q_norm`, `...k_norm`,
`layers.{i}.mlp.{gate,up,down}_proj`, `layers.{i}.{input,post_attention}_layernorm`, `fc`,
`hidden_norm`, `norm`. Saving/loading and the target check live in `qfd.models.drafter_io`
(re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qfd.drafter_losses import block_attention_mask, context_window_start, per_block_attention_mask
from qfd.kernels import attention_triton
from qfd.models.linear import Linear, gated_mlp_hidden  # nn.Linear + a CPU fast path for few rows
from qfd.models.target import RMSNorm  # the plain form (w * norm(x), cast before the weight), as DFlash's Qwen3 layers


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    target_hidden_size: int | None = None  # defaults to hidden_size
    sliding_window: int | None = None  # attend to only the last W context tokens (None: all)
    extra: dict = field(default_factory=dict, compare=False)  # carried-through HF fields (bos/eos ids)

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2 (slot 0 is the committed token)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("sliding_window must be >= 1 or None")

    def with_(self, **changes) -> "DFlashConfig":
        return replace(self, **changes)


def default_tap_layers(num_target_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` target layers spread evenly from layer 1 to n-3 (paper: [1, 8, 15, 22, 29] for 32
    layers); fewer for small targets (n-3 < count), at least one."""
    last = max(1, num_target_layers - 3)
    first = min(1, num_target_layers - 1)
    count = max(1, min(count, last - first + 1))
    if count == 1:
        return (first,)
    step = (last - first) / (count - 1)
    return tuple(sorted({int(first + i * step + 0.5) for i in range(count)}))


def pick_mask_token_id(vocab_size: int, tokenizer=None) -> int:
    """An id of the target's vocabulary that real text never uses, for the MASK slots.

    In order: (1) the first embedding row beyond the tokenizer's vocabulary (padding rows, e.g.
    Qwen3: 151669, Qwen3.5: 248077 - the ids z-lab's drafters use); (2) the highest-id added
    special token that is not bos/eos/pad/unk and does not occur in the chat template (e.g.
    SmolLM2: 16 `<empty_output>`); (3) the last id of the vocabulary."""
    if tokenizer is None:
        return vocab_size - 1
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    reserved = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else ""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = [
        token_id
        for token_id, token in decoder.items()
        if getattr(token, "special", False) and token_id not in reserved and token_id < vocab_size and str(token) not in template
    ]
    return max(candidates) if candidates else vocab_size - 1


def config_for_target(target_config: dict, tokenizer=None, *, num_layers: int = 5, block_size: int = 16, taps: tuple[int, ...] | None = None, num_taps: int = 5, sliding_window: int | None = None, intermediate_size: int | None = None, mask_token_id: int | None = None) -> DFlashConfig:
    """A drafter config whose sizes follow the target (paper: hidden = target hidden, heads as
    the target, 5 layers). `target_config`: the target's config.json (Qwen3.5 nests text_config)."""
    text = target_config.get("text_config", target_config)
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    layers = text["num_hidden_layers"]
    rope = text.get("rope_parameters") or {}
    taps = tuple(taps) if taps else default_tap_layers(layers, num_taps)
    if max(taps) >= layers or min(taps) < 0:
        raise ValueError(f"tap layers {taps} out of range for a {layers}-layer target")
    return DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or hidden // heads,
        intermediate_size=intermediate_size or text["intermediate_size"],
        vocab_size=text["vocab_size"],
        target_layer_ids=taps,
        mask_token_id=mask_token_id if mask_token_id is not None else pick_mask_token_id(text["vocab_size"], tokenizer),
        num_target_layers=layers,
        block_size=block_size,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))),
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        sliding_window=sliding_window,
        extra={k: text[k] for k in ("bos_token_id", "eos_token_id") if k in text},
    )


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [..., T] long -> cos, sin [..., T, head_dim] (HF/neox half-rotation layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, T, d]; cos/sin: [b or 1, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # k/v as one linear, set by qfd.models.fuse for inference (q stays apart: the context
        # append projects k/v only)
        self.kv_proj: nn.Module | None = None
        self.kv_sizes: tuple[int, ...] = ()

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [b, T, H] (context features or normed block states), positions [b or 1, T]; rope:
        their (cos, sin) where the caller computed them once for every layer (`rope_cos_sin`).
        Returns k, v: [b, kv_heads, T, d] (k normed and rotated)."""
        b, t, _ = x.shape
        d = self.cfg.head_dim
        if self.kv_proj is None:
            k, v = self.k_proj(x), self.v_proj(x)
        else:
            k, v = torch.split(self.kv_proj(x), self.kv_sizes, dim=-1)
        k = self.k_norm(k.view(b, t, -1, d)).transpose(1, 2)
        v = v.view(b, t, -1, d).transpose(1, 2)
        cos, sin = rope if rope is not None else rope_cos_sin(positions, d, self.cfg.rope_theta, k.dtype)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, mask: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [b, Q, H] normed block states at `positions` [b or 1, Q]; k_ctx/v_ctx: [b, kv, C, d]
        context keys/values already projected; mask: bool [Q, C + Q] or None (all visible);
        rope: the positions' (cos, sin), computed once for every layer (else here)."""
        b, q_len, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, d)).transpose(1, 2)
        rope = rope if rope is not None else rope_cos_sin(positions, d, self.cfg.rope_theta, q.dtype)
        q = apply_rope(q, *rope)
        k_blk, v_blk = self.project_kv(x, positions, rope)
        k = torch.cat([k_ctx.to(k_blk.dtype), k_blk], dim=2)
        v = torch.cat([v_ctx.to(v_blk.dtype), v_blk], dim=2)
        if (mask is None or mask.dim() == 2) and not torch.is_grad_enabled() and attention_triton.takes(q):
            # A draft on the GPU: the target steps' split-KV kernels. SDPA runs one program per
            # head over all C keys (16 programs on a 132-SM GPU: at a 1K window ~75 us a layer,
            # docs/benchmarks.md 2026-12-06) after copying K/V per query head; these split the
            # keys over the SMs and read each kv head once for its query heads.
            if mask is None:  # all visible
                mask = torch.ones(q_len, k.shape[2], dtype=torch.bool, device=q.device)
            out = attention_triton.split_attention(q, k, v, mask)
        else:
            groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        # gate/up as one linear, set by qfd.models.fuse for inference
        self.gate_up_proj: nn.Module | None = None
        self.gate_up_sizes: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_mlp_hidden(self, x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, positions, k_ctx, v_ctx, mask, rope=None):
        h, x = self.post_attention_layernorm.add_and_norm(h, self.self_attn(self.input_layernorm(h), positions, k_ctx, v_ctx, mask, rope))
        return h + self.mlp(x)


class DrafterCache:
    """Per-layer context K/V of the committed tokens, preallocated to `max_len` positions.

    k, v: [layers, batch, kv_heads, max_len, head_dim]; positions < `length` are valid."""

    def __init__(self, cfg: DFlashConfig, max_len: int, batch: int = 1, device=None, dtype=torch.float32):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    def rollback(self, n: int) -> None:
        """Keep the first n context positions."""
        self.length = max(0, min(self.length, n))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [b, T, k*H] (target hidden_states[i+1] of the tap layers, concatenated) ->
        context features [b, T, H]."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def _block_inputs(self, first_tokens: torch.Tensor, embed: Callable, block_len: int | None = None) -> torch.Tensor:
        """first_tokens [..., 1] -> embeddings of [token, MASK x (n-1)]: [..., n, H], n = block_len
        (default B)."""
        masks = torch.full((*first_tokens.shape[:-1], (block_len or self.block_size) - 1), self.mask_token_id, dtype=first_tokens.dtype, device=first_tokens.device)
        return embed(torch.cat([first_tokens, masks], dim=-1)).to(self.fc.weight.dtype)

    # -- training path: all blocks of one sequence in one forward ------------------------------
    def forward_train(self, taps: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor, embed: Callable) -> torch.Tensor:
        """Teacher-forced blocks at `anchors` of one sequence.

        taps: [1, T, k*H] target taps of the whole sequence; input_ids: [T]; anchors: [N] (each
        block sees context strictly before its anchor, see block_attention_mask).
        Returns final-normed hidden states of the predicted slots: [N, B-1, H]."""
        bsz = self.block_size
        t = input_ids.numel()
        ctx = self.fuse(taps)
        ctx_pos = torch.arange(t, device=input_ids.device).view(1, -1)
        h = self._block_inputs(input_ids[anchors].view(-1, 1), embed).reshape(1, -1, self.cfg.hidden_size)
        positions = (anchors.view(-1, 1) + torch.arange(bsz, device=anchors.device)).view(1, -1)
        mask = block_attention_mask(anchors, t, bsz, self.cfg.sliding_window)
        for layer in self.layers:
            k_ctx, v_ctx = layer.self_attn.project_kv(ctx, ctx_pos)
            h = layer(h, positions, k_ctx, v_ctx, mask)
        return self.norm(h).view(-1, bsz, self.cfg.hidden_size)[:, 1:]

    def forward_blocks(self, taps: torch.Tensor, input_ids: torch.Tensor, block_seq: torch.Tensor, anchors: torch.Tensor, embed: Callable) -> torch.Tensor:
        """forward_train for several sequences at once, each block a batch row of its own.

        taps: [G, T, k*H] taps of G right-padded sequences (causal: padding on the right does
        not change the taps before it); input_ids: [G, T]; block_seq, anchors: [N] (sequence and
        position of each block). Block n attends to its sequence's context before its anchor and
        to its own B tokens (per_block_attention_mask) - the same function as forward_train, with
        attention work N*B*(T+B) instead of N*B*(T+N*B).
        Returns final-normed hidden states of the predicted slots: [N, B-1, H]."""
        bsz = self.block_size
        t = input_ids.shape[1]
        ctx = self.fuse(taps)
        ctx_pos = torch.arange(t, device=input_ids.device).view(1, -1)
        h = self._block_inputs(input_ids[block_seq, anchors].view(-1, 1), embed)  # [N, B, H]
        positions = anchors.view(-1, 1) + torch.arange(bsz, device=anchors.device)  # [N, B]
        mask = per_block_attention_mask(anchors, t, bsz, self.cfg.sliding_window)
        for layer in self.layers:
            k_ctx, v_ctx = layer.self_attn.project_kv(ctx, ctx_pos)
            h = layer(h, positions, k_ctx[block_seq], v_ctx[block_seq], mask)
        return self.norm(h)[:, 1:]

    # -- inference path ----------------------------------------------------------------------
    def new_cache(self, max_len: int, batch: int = 1, device=None, dtype=None) -> DrafterCache:
        weight = self.fc.weight
        return DrafterCache(self.cfg, max_len, batch, device=device or weight.device, dtype=dtype or weight.dtype)

    @torch.no_grad()
    def append_context(self, cache: DrafterCache, taps: torch.Tensor, start_pos: int) -> None:
        """Add the context K/V of newly committed tokens at positions start_pos .. start_pos+n-1.

        taps: [batch, n, k*H]. start_pos <= cache.length (anything beyond start_pos is
        overwritten); afterwards cache.length == start_pos + n."""
        n = taps.shape[1]
        if start_pos > cache.length:
            raise ValueError(f"append_context at {start_pos} leaves a gap: the cache holds {cache.length} positions")
        if start_pos + n > cache.max_len:
            raise ValueError(f"drafter cache overflow: {start_pos + n} > max_len {cache.max_len}")
        self.write_context(cache, taps, torch.arange(start_pos, start_pos + n, device=taps.device))
        cache.length = start_pos + n

    def write_context(self, cache: DrafterCache, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Context K/V of `taps` [batch, n, k*H] into every layer's cache at `positions` [n]
        (a tensor: the fixed-shape append passes a device tensor, nothing Python-side)."""
        store_context_kv(cache, self.context_kv(taps, positions), positions)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context (k, v) [batch, kv, n, d] of `taps` at `positions` [n], not stored."""
        ctx = self.fuse(taps)
        positions = positions.view(1, -1)
        rope = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, ctx.dtype)  # once, not per layer
        return [layer.self_attn.project_kv(ctx, positions, rope) for layer in self.layers]

    @torch.no_grad()
    def draft(self, cache: DrafterCache, first_token, start_pos: int, embed: Callable, head: Callable, return_logits: bool = False, num_drafts: int | None = None, block_len: int | None = None):
        """Denoise the block [first_token, MASK x (B-1)] at positions start_pos..start_pos+B-1
        against the cached context (positions < start_pos; the last W with a sliding window).

        first_token: int, [batch] or [batch, 1] long. Returns tokens [batch, k] (argmax), and
        logits [batch, k, V] too with return_logits, for the first k = num_drafts (default
        B-1) predicted slots. The block forward always covers all B slots (the drafter was
        trained on full blocks of MASKs, and the slots attend to each other), so the k tokens
        equal the first k of a full draft; only the LM head, over a vocabulary-wide matmul per
        slot, is skipped for the slots nobody will verify.

        `block_len` n (default B; Engine(short_block=True) passes k + 1) runs the block over only
        its first n slots, [first_token, MASK x (n-1)]: n/B of the block's work, but not the
        trained function - the slots no longer see the later MASKs - so the drafts may differ
        from a full block's (verification keeps the output the target's either way).

        A `head` with `vocab_ids` (qfd.draft_vocab.DraftVocabHead, `--draft-vocab N`) gives
        logits over those N ids only: the argmax is mapped back through them, and returned
        logits are scattered to [batch, k, V] with -inf outside the subset."""
        if cache.length < start_pos:
            raise ValueError(f"draft at {start_pos}: the cache holds only {cache.length} context positions")
        device = cache.k.device
        first = torch.as_tensor(first_token, device=device, dtype=torch.long).reshape(-1, 1)
        if first.shape[0] == 1 and cache.k.shape[1] > 1:
            first = first.expand(cache.k.shape[1], 1)
        n, k = self.block_shape(block_len, num_drafts)
        h = self._block_inputs(first, embed, n)
        positions = torch.arange(start_pos, start_pos + n, device=device).view(1, -1)
        lo = context_window_start(start_pos, self.cfg.sliding_window)
        rope = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)  # once, not twice per layer
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, cache.k[i, :, :, lo:start_pos], cache.v[i, :, :, lo:start_pos], None, rope)
        hidden = self.norm(h[:, 1 : 1 + k])  # the final norm is per position: slicing first is exact
        weight = getattr(head, "weight", None)
        logits = head(hidden.to(weight.dtype) if weight is not None else hidden)
        tokens = logits.argmax(-1)
        if getattr(head, "vocab_ids", None) is not None:  # a draft vocabulary: subset index -> vocabulary id
            tokens = head.to_vocab(tokens)
            logits = head.full_logits(logits) if return_logits else logits
        return (tokens, logits) if return_logits else tokens

    def block_shape(self, block_len: int | None, num_drafts: int | None) -> tuple[int, int]:
        """(n, k): the block slots a draft runs (default B) and the drafts it returns (default
        n - 1), checked: 2 <= n <= B and 1 <= k <= n - 1."""
        n = self.block_size if block_len is None else int(block_len)
        k = n - 1 if num_drafts is None else int(num_drafts)
        if not 2 <= n <= self.block_size or not 1 <= k <= n - 1:
            raise ValueError(f"need 2 <= block_len <= {self.block_size} and 1 <= num_drafts <= block_len - 1 (got {block_len}, {num_drafts})")
        return n, k


def store_context_kv(cache: DrafterCache, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> None:
    """Write `DFlashDrafter.context_kv`'s per-layer (k, v) into the cache at `positions`."""
    for i, (k, v) in enumerate(kv):
        cache.k[i].index_copy_(2, positions, k.to(cache.k.dtype))
        cache.v[i].index_copy_(2, positions, v.to(cache.v.dtype))


def num_parameters(drafter: DFlashDrafter) -> int:
    return sum(p.numel() for p in drafter.parameters())


from qfd.models.drafter_io import (  # noqa: E402  (re-exported: one import site for callers)
    hf_config_dict,
    load_drafter,
    read_drafter_config,
    save_drafter,
    verify_drafter_target,
)

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "DrafterCache",
    "config_for_target",
    "default_tap_layers",
    "pick_mask_token_id",
    "hf_config_dict",
    "load_drafter",
    "read_drafter_config",
    "save_drafter",
    "verify_drafter_target",
]
