"""qfd's runtime target model (gpt-fast style, plain PyTorch): Llama, Qwen3 and Qwen3.5 text.

Module tree and parameter names mirror transformers' (`model.embed_tokens`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `...mlp.{gate,up,down}_proj`, `...linear_attn.*`,
`model.norm`, `lm_head`), so an HF state dict loads as-is and INT4 linears swap in by path.
After loading, `qfd.models.fuse.fuse_projections` stacks the linears that read the same input
(q/k/v, gate/up, Gated DeltaNet's in_proj_*) into one each; the forwards use those when set.

    model = TargetModel(TargetConfig.from_hf(config_json))
    cache = model.new_cache(max_len)          # static buffers, see qfd.models.cache
    out = model(ids, cache, tap_layers=(1, 8), last_only=False)   # out.logits, out.taps

Family differences (all from transformers' modeling files):
- llama: RMSNorm `w * norm(x)`, full RoPE, optional q/k/v/o and MLP biases.
- qwen3: as llama plus per-head RMSNorm on q and k before RoPE.
- qwen3_5: RMSNorms are zero-centred, `(1 + w) * norm(x)`; layers alternate Gated DeltaNet
  (`linear_attention`) and gated attention (`full_attention`): q_proj emits [q | gate] per head,
  output *= sigmoid(gate), RoPE on the first `partial_rotary_factor` of each head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qfd.errors import QfdError
from qfd.kernels import attention_inputs_triton, attention_triton, norm_triton
from qfd.models import rope as rope_math
from qfd.models.cache import GDNState, TargetCache
from qfd.models.gdn import GatedDeltaNet, tree_structure
from qfd.models.linear import Linear, gated_mlp_hidden  # nn.Linear + a CPU fast path for few rows

FAMILIES = ("llama", "qwen3", "qwen3_5")
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class TargetConfig:
    """The architecture, read strictly from an HF config.json (text part)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope: dict = field(default_factory=dict)
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf(cls, config: dict[str, Any], family: str) -> "TargetConfig":
        """From a config.json dict; the full Qwen3.5 checkpoint nests the text part in text_config.
        Values qfd does not implement raise QfdError naming them."""
        if family not in FAMILIES:
            raise QfdError(f"family '{family}' has no runtime model; qfd runs {', '.join(FAMILIES)}")
        text = dict(config.get("text_config") or config)
        if "text_config" in config and "tie_word_embeddings" in config:
            # the full Qwen3.5 checkpoint decides tying at the top level (its lm_head is outside the text model)
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        if text.get("hidden_act", "silu") != "silu":
            raise QfdError(f"hidden_act '{text['hidden_act']}' is not supported by qfd's runtime model (only silu)")
        if text.get("use_sliding_window"):
            raise QfdError("sliding-window attention in the target is not supported by qfd's runtime model (use_sliding_window / sliding_window)")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_math.check_rope(rope)
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
        heads = int(text["num_attention_heads"])
        n_layers = int(text["num_hidden_layers"])
        layer_types = tuple(text.get("layer_types") or ["full_attention"] * n_layers)
        unknown = sorted(set(layer_types) - set(LAYER_TYPES if family == "qwen3_5" else ("full_attention",)))
        if unknown or len(layer_types) != n_layers:
            raise QfdError(f"layer_types {unknown or layer_types} are not supported by qfd's runtime {family} model")
        extra = {}
        if family == "qwen3_5":
            extra = {name: int(text[name]) for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")}
        return cls(
            family=family,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope=rope,
            partial_rotary_factor=partial,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            mlp_bias=bool(text.get("mlp_bias", False)),
            layer_types=layer_types,
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            **extra,
        )


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V] (last_only: [B, 1, V])
    taps: torch.Tensor | None  # [B, T, len(tap_layers) * hidden]


class TreeStep(NamedTuple):
    """What a tree verify's layers read (TargetModel.verify_tree), computed once per forward:
    attention writes token i's K/V at cache slot slots[i] and attends to the keys visible[i]
    marks (`tree_visibility`); Gated DeltaNet continues each node from its parent's state
    (parents, conv_index: qfd.models.gdn.tree_structure; None in attention-only models)."""

    slots: torch.Tensor
    visible: torch.Tensor
    parents: torch.Tensor | None
    conv_index: torch.Tensor | None


class StepKeys(NamedTuple):
    """What a step's attention layers share (`step_keys`, once per forward instead of once per
    layer): token i's K/V go to cache slot slots[i]; it sees the keys visible[i] marks; no key from
    slot key_count on is visible (the static cache's unfilled tail: the kernels need not read it)."""

    slots: torch.Tensor
    visible: torch.Tensor
    key_count: torch.Tensor


def step_keys(cache: TargetCache | None, positions: torch.Tensor, tree: TreeStep | None) -> StepKeys | None:
    """The step's StepKeys; None without a cache or for a prompt (more tokens than a step takes:
    `prompt_attention` over the filled keys)."""
    if cache is None:
        return None
    if tree is not None:
        return StepKeys(tree.slots, tree.visible, tree.slots[-1:] + 1)
    steps = positions.shape[0]
    if PROMPT_ATTENTION and cache.prompt_start(steps) is not None:
        return None
    # a key is visible to a query when its position is not after the query's
    visible = torch.arange(cache.key_count(steps), device=positions.device)[None, :] <= positions[:, None]
    return StepKeys(positions, visible, positions[-1:] + 1)


class RMSNorm(nn.Module):
    """Llama/Qwen3: w * norm(x) (cast before the weight); Qwen3.5 (`zero_centered`):
    (1 + w) * norm(x) in float32, then cast."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps, self.zero_centered = eps, zero_centered

    @property
    def mode(self) -> int:
        return norm_triton.ZERO_CENTERED if self.zero_centered else norm_triton.PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_triton.norm(x, self.weight, self.eps, self.mode)  # one launch in a graphed step, else torch's form

    def add_and_norm(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + x, its norm): a residual add and this norm (`norm_triton.add_and_norm`)."""
        return norm_triton.add_and_norm(h, x, self.weight, self.eps, self.mode)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.gated = cfg.family == "qwen3_5"  # q_proj emits [query | output gate] per head
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.heads * self.head_dim * (2 if self.gated else 1), bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        # q/k/v as one linear, set by qfd.models.fuse after loading (runtime only)
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes: tuple[int, ...] = ()
        if cfg.family in ("qwen3", "qwen3_5"):
            zero_centered = cfg.family == "qwen3_5"
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, zero_centered)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, cache: TargetCache | None, layer: int, positions: torch.Tensor, step: StepKeys | None = None) -> torch.Tensor:
        """x: [B, T, hidden]; cos/sin: [T, rotary_dim]; positions: [T] absolute positions.
        step: a decode / verify / tree step's cache slots and visible keys (`step_keys`), computed
        once per forward; None for a forward without a cache or a prompt's."""
        B, T, _ = x.shape
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = torch.split(self.qkv_proj(x), self.qkv_sizes, dim=-1)
        q = q.view(B, T, self.heads, -1)
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)  # [B, T, heads, hd] each
        k = k.view(B, T, self.kv_heads, self.head_dim)
        v = v.view(B, T, self.kv_heads, self.head_dim)
        if step is not None and cache.static and attention_inputs_triton.use_kernel(q, cos, cache.k[layer]):
            # norms, rotary and the K/V cache writes in one launch; the output gate in the merge kernel
            keys, values = cache.k[layer], cache.v[layer]
            q = attention_inputs_triton.prepare(q, k, v, self.q_norm, self.k_norm, cos, sin, keys, values, step.slots)
            out, gate = step_attention(q, keys, values, step.visible, step.key_count, gate), None
        else:
            out = self._attention(q, k, v.transpose(1, 2), cos, sin, cache, layer, positions, step)
        out = out.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(out)

    def _attention(self, q, k, v, cos, sin, cache: TargetCache | None, layer: int, positions: torch.Tensor, step: StepKeys | None) -> torch.Tensor:
        """The torch form from the projections to the attention's output [B, heads, T, hd]."""
        T = q.shape[1]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope_math.apply_rope(q.transpose(1, 2), cos, sin)  # [B, heads, T, hd]
        k = rope_math.apply_rope(k.transpose(1, 2), cos, sin)
        if cache is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        if step is None:  # a prompt: fused attention over the filled keys only
            keys, values = cache.write_kv(layer, k, v, positions)
            start = cache.prompt_start(T)
            return prompt_attention(q, keys[:, :, : start + T], values[:, :, : start + T], start)
        keys, values = cache.write_kv(layer, k, v, step.slots)
        return step_attention(q, keys, values, step.visible, step.key_count)


def tree_visibility(num_keys: int, slots: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """[T, num_keys] bool for a tree verify: every key before slots[0] (the committed context)
    and, among the T tree slots, each token's ancestors and itself. Built from tensors only
    (no Python int of the step), so a CUDA graph can replay it at any start."""
    rel = torch.arange(num_keys, device=slots.device) - slots[0]  # key slot relative to the tree
    in_tree = (rel >= 0) & (rel < ancestors.shape[1])
    return (rel < 0)[None, :] | (in_tree[None, :] & ancestors[:, rel.clamp(0, ancestors.shape[1] - 1)])


PROMPT_ATTENTION = True  # bench_steps.py turns it off to time the prefill as before, side by side


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of a prompt's T queries at positions start.. over keys [B, kv_heads,
    start + T, hd] (the cache's filled part), through SDPA's fused kernels. `grouped_attention`
    would materialise [heads * T, S] fp32 scores over the whole static cache: at Qwen3.5-4B
    shape an 8K prompt needs 4.4 GB per layer for them, and their passes cost more than the
    layer's matmuls."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # query head h reads kv head h // group (transformers' repeat_kv)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[2]
    mask = torch.arange(k.shape[2], device=q.device)[None, :] <= torch.arange(start, start + T, device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, key_count: torch.Tensor | None = None,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """A decode / verify / tree step's attention over the cache: the split-KV Triton kernels
    where they are switched on and run (`qfd.kernels.attention_triton`; they read only the first
    `key_count` keys), else `grouped_attention` (the mask alone). gate [B, T, heads, hd]: the
    output times sigmoid(gate) (Qwen3.5's output gate; in the kernels' merge)."""
    if attention_triton.takes(q):
        return attention_triton.split_attention(q, k, v, mask, key_count, gate)
    out = grouped_attention(q, k, v, mask)
    return out if gate is None else out * torch.sigmoid(gate).transpose(1, 2)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention for few queries over a cache, grouped-query without copying K/V.

    q: [B, heads, T, hd]; k, v: [B, kv_heads, S, hd]; mask: [T, S] bool (True = visible).
    Query head h reads kv head h // (heads / kv_heads), as transformers' repeat_kv does.
    (torch's CPU SDPA with a mask and GQA is ~10x slower than this at decode shapes.)"""
    B, H, T, hd = q.shape
    kv_heads, group = k.shape[1], H // k.shape[1]
    q = q.reshape(B, kv_heads, group * T, hd)
    scores = (q @ k.transpose(-1, -2)) * hd**-0.5  # [B, kv_heads, group*T, S]
    scores = scores.masked_fill(~mask.repeat(group, 1), float("-inf"))
    probs = scores.float().softmax(-1).to(q.dtype)
    return weighted_values(probs, v).reshape(B, H, T, hd)


# On CUDA, `probs @ v` with few query rows over a long static cache is one GEMM of M = group*T
# rows and a long reduction: cuBLAS runs it on a handful of CTAs (H200, Qwen3.5-4B shape, 8.5K
# cache: ~80 us per layer, 13% of a compiled decode; docs/benchmarks.md). Split the keys into
# chunks of VALUE_CHUNK, one batched GEMM over all chunks, then sum the partials: split-K by hand.
VALUE_CHUNK = 512
SPLIT_VALUES = True  # bench_steps.py --reference-kernels turns it off for a side-by-side run


def static_cache_len(max_len: int, device: torch.device) -> int:
    """A static cache's length on CUDA: `max_len` rounded up to whole VALUE_CHUNKs. Then the
    split values product reads the whole K/V buffer as [chunks, VALUE_CHUNK, hd] in place; with
    a partial last chunk torch.compile copies the sliced V of every attention layer in every
    step (`clone_slice_view` in the H100 profiles: ~10 us per layer at an 8.5K cache). The
    extra positions stay masked."""
    if torch.device(device).type != "cuda":
        return max_len
    return -(-max_len // VALUE_CHUNK) * VALUE_CHUNK


def weighted_values(probs: torch.Tensor, v: torch.Tensor, split: bool | None = None) -> torch.Tensor:
    """probs [B, kv, R, S] @ v [B, kv, S, hd] -> [B, kv, R, hd], split over S when `split`
    (default: on CUDA, for S of 4 chunks or more)."""
    B, kv, R, S = probs.shape
    n = S // VALUE_CHUNK
    if split is None:
        split = SPLIT_VALUES and probs.is_cuda and n >= 4
    if not split or n == 0:
        return probs @ v
    cut = n * VALUE_CHUNK
    p = probs[..., :cut].reshape(B, kv, R, n, VALUE_CHUNK).transpose(2, 3)  # [B, kv, n, R, C]
    parts = p @ v[:, :, :cut].reshape(B, kv, n, VALUE_CHUNK, -1)  # [B, kv, n, R, hd]
    out = parts.sum(2, dtype=torch.float32)
    if cut < S:
        out = out + (probs[..., cut:] @ v[:, :, cut:]).float()
    return out.to(probs.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        # gate/up as one linear, set by qfd.models.fuse after loading (runtime only)
        self.gate_up_proj: nn.Module | None = None
        self.gate_up_sizes: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_mlp_hidden(self, x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, index: int):
        super().__init__()
        self.index = index
        self.kind = cfg.layer_types[index]
        zero_centered = cfg.family == "qwen3_5"
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered)

    def forward(self, h, cos, sin, cache: TargetCache | None, positions: torch.Tensor, tree: TreeStep | None = None) -> torch.Tensor:
        _, h, mlp_out = self.parts(h, None, cos, sin, cache, positions, tree, step_keys(cache, positions, tree))
        return h + mlp_out

    def parts(self, h, residual, cos, sin, cache: TargetCache | None, positions: torch.Tensor, tree: TreeStep | None,
              step: StepKeys | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer with its residual adds joined to the norms after them (`RMSNorm.add_and_norm`:
        one launch each in graphed steps): h + residual (the previous layer's MLP output,
        or None) is this layer's input. Returns (that input - the previous layer's output, which
        taps read -, h after attention, the MLP's output: the next layer adds them)."""
        if residual is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add_and_norm(h, residual)
        layer_input = h
        if self.kind == "linear_attention":
            x = self.linear_attn(x, None if cache is None else cache.gdn[self.index], None if tree is None else (tree.parents, tree.conv_index))
        else:
            x = self.self_attn(x, cos, sin, cache, self.index, positions, step)
        h, x = self.post_attention_layernorm.add_and_norm(h, x)
        return layer_input, h, self.mlp(x)


class Body(nn.Module):
    """transformers' `model.*`: embeddings, decoder layers, final norm, RoPE frequencies."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=cfg.family == "qwen3_5")
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_rope()

    @property
    def rotary_dim(self) -> int:
        return int(self.config.head_dim * self.config.partial_rotary_factor)

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the RoPE inverse frequencies (non-persistent; needed after meta init)."""
        if device is None:
            device = self.model.embed_tokens.weight.device
            device = "cpu" if device.type == "meta" else device
        inv = rope_math.inv_frequencies(self.rotary_dim, self.config.rope_theta, self.config.rope)
        self.model.inv_freq = inv.to(device)

    @property
    def norm(self) -> nn.Module:
        """The final RMSNorm (apply before `head` to get logits)."""
        return self.model.norm

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, hidden] embeddings."""
        return self.model.embed_tokens(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] -> [B, T, V] logits. The final norm is NOT applied here."""
        return self.lm_head(hidden)

    lm_head_fn = head

    def new_cache(self, max_len: int, batch: int = 1, *, max_verify: int = 16, static: bool = False) -> TargetCache:
        """Preallocated cache for up to `max_len` tokens. Forwards of at most `max_verify` tokens
        record the GDN state after every position (O(1) rollback); see qfd.models.cache."""
        cfg, weight = self.config, self.model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        if static:
            max_len = static_cache_len(max_len, device)
        k, v, gdn = {}, {}, {}
        attention = [layer.index for layer in self.model.layers if layer.kind == "full_attention"]
        # every attention layer's K and V are views of one buffer, so that keeping a tree's
        # path (cache.keep_tree_path) moves all of them in one gather + one copy
        kv = torch.zeros(2, len(attention), batch, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype=dtype, device=device)
        for slot, index in enumerate(attention):
            k[index], v[index] = kv[0, slot], kv[1, slot]
        for layer in self.model.layers:
            if layer.kind == "linear_attention":
                la = layer.linear_attn
                gdn[layer.index] = GDNState(batch, la.conv_dim, la.kernel, la.num_v_heads, la.head_k_dim, la.head_v_dim, max_verify, dtype, device)
        return TargetCache(k, v, gdn, max_len, static=static, kv=kv, max_verify=max_verify)

    def forward(self, input_ids: torch.Tensor, cache: TargetCache | None = None, tap_layers: Sequence[int] = (), last_only: bool = False, positions: torch.Tensor | None = None) -> TargetOutput:
        """input_ids [B, T]. With a cache: the tokens continue the cached sequence at position
        cache.length (prefill, 1-token decode or a multi-token verify block) and the cache
        advances by T. Without: a fresh causal forward over the whole sequence.
        taps: outputs of decoder layers `tap_layers` (= HF hidden_states[i + 1]; for the last
        layer that is after the final norm, as in transformers), concatenated in tap order."""
        T = input_ids.shape[1]
        start = 0 if cache is None else cache.begin(T)
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device)
        out = self.forward_at(input_ids, cache, positions, tap_layers, last_only)
        if cache is not None:
            cache.end(T)
        return out

    def verify_tree(self, input_ids: torch.Tensor, cache: TargetCache, depths: torch.Tensor, ancestors: torch.Tensor, tap_layers: Sequence[int] = ()) -> TargetOutput:
        """Verify a draft tree (qfd.tree.tree_inputs) continuing the cached sequence: node i at
        position cache.length + depths[i], in cache slot cache.length + i, seeing the context
        and its ancestors. The cache advances by N; `cache.keep_tree_path` then keeps one path."""
        size = input_ids.shape[1]
        start = cache.begin(size)
        slots = torch.arange(start, start + size, device=input_ids.device)
        out = self.forward_at(input_ids, cache, depths.to(slots.device) + start, tap_layers, False, slots, ancestors.to(slots.device))
        cache.end(size)
        return out

    def forward_at(self, input_ids: torch.Tensor, cache: TargetCache | None, positions: torch.Tensor, tap_layers: Sequence[int] = (), last_only: bool = False, slots: torch.Tensor | None = None, ancestors: torch.Tensor | None = None) -> TargetOutput:
        """The forward at explicit `positions` [T], without the cache's length bookkeeping
        (the caller does cache.begin/end): the piece to torch.compile / CUDA-graph with a
        static cache, where no Python int may change between steps.
        slots + ancestors: verify a draft tree (qfd.tree.tree_inputs): token i at RoPE position
        positions[i], cache slot slots[i], seeing (and continuing) its ancestors."""
        tree = None
        if slots is not None:
            if cache is None:
                raise ValueError("a tree verify needs a cache")
            parents = conv_index = None
            if cache.gdn:
                parents, conv_index = tree_structure(ancestors, next(iter(cache.gdn.values())).conv.shape[-1] + 1)
            tree = TreeStep(slots, tree_visibility(cache.key_count(input_ids.shape[1]), slots, ancestors), parents, conv_index)
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_math.cos_sin(self.model.inv_freq, positions, h.dtype)
        wanted = {int(layer): slot for slot, layer in enumerate(tap_layers)}
        if len(wanted) != len(tap_layers) or not all(0 <= i < len(self.model.layers) for i in wanted):
            raise ValueError(f"tap_layers {tuple(tap_layers)} must be distinct layer indices in [0, {len(self.model.layers)})")
        taps: list[torch.Tensor | None] = [None] * len(wanted)
        step = step_keys(cache, positions, tree)
        residual = None  # the last layer's MLP output, added in the next norm's launch
        for layer in self.model.layers:
            layer_input, h, residual = layer.parts(h, residual, cos, sin, cache, positions, tree, step)
            if layer.index - 1 in wanted:
                taps[wanted[layer.index - 1]] = layer_input
        h, normed = self.model.norm.add_and_norm(h, residual)
        last = len(self.model.layers) - 1
        if last in wanted:
            # transformers' hidden_states[-1] is the final-normed output, not the raw layer's
            taps[wanted[last]] = normed
        if last_only:
            normed = normed[:, -1:]
        logits = self.lm_head(normed)
        return TargetOutput(logits=logits, taps=torch.cat(taps, dim=-1) if taps else None)
