"""Gated DeltaNet (Yang, Kautz, Hatamizadeh, arXiv 2412.06464), the linear-attention token mixer
of Qwen3.5, as transformers' `Qwen3_5GatedDeltaNet` computes it.

Per value head, with an L2-normalised key k_t and query q_t (scaled by 1/sqrt(d_k)), a decay
g_t <= 0 (log space) and a write strength beta_t in (0, 1), the recurrent state
S_t in R^{d_k x d_v} evolves by the gated delta rule (paper eq. 10):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,   o_t = S_t^T q_t.

Before it, a depthwise causal conv1d (kernel K, SiLU) mixes the q/k/v channels over the last
K tokens; its state is the last K-1 pre-conv inputs. After it, a gated RMSNorm (weight w, not
1 + w) and SiLU(z) gate, then out_proj.

Two exact forms: `recurrent_gated_delta` steps token by token and can return the state after
every position (decode, 16-token verify: what rollback needs); `chunked_gated_delta` is the
chunkwise-parallel WY form of the paper's section 3 for long prefills (final state only).
Both work in float32, as transformers' reference kernels do.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from qfd.kernels import gdn_chunk_triton, gdn_fla, launch_or_fallback, norm_triton
from qfd.models.linear import Linear  # nn.Linear + a CPU fast path for few rows


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ||x|| over the last dim, with flash-linear-attention's epsilon placement."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32, L2-normalised q (then scaled by d_k^-1/2) and k; any [..., d_k] layout."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def delta_rule(state, q_t, k_t, v_t, g_t, beta_t, record: torch.Tensor | None = None):
    """One token of the gated delta rule: state [B, H, dk, dv], the token's q/k [B, H, dk],
    v [B, H, dv], g/beta [B, H] (float32). Returns (new state, output [B, H, dv]). `record`
    [B, H, dk + dv + 1], if given, receives the token's update (k, delta, decay): the state
    after it is `replay_update(state, record)`."""
    decay = g_t.exp()
    state = state * decay[..., None, None]
    delta = (v_t - torch.einsum("bhk,bhkv->bhv", k_t, state)) * beta_t[..., None]
    if record is not None:
        record.copy_(torch.cat([k_t, delta, decay[..., None]], dim=-1))
    state = state + k_t[..., :, None] * delta[..., None, :]
    return state, torch.einsum("bhk,bhkv->bhv", q_t, state)


def replay_update(state: torch.Tensor, record: torch.Tensor) -> torch.Tensor:
    """The state after a token from the state before it and the token's record [B, H, dk + dv
    + 1] (`delta_rule`): the same decay and rank-one update, without the reductions."""
    dk = state.shape[-2]
    k_t, delta, decay = record[..., :dk], record[..., dk:-1], record[..., -1]
    return state * decay[..., None, None] + k_t[..., :, None] * delta[..., None, :]


def recurrent_gated_delta(q, k, v, g, beta, state, history: torch.Tensor | None = None, records: torch.Tensor | None = None):
    """Token-by-token gated delta rule.

    q, k: [B, T, H, dk] already prepared (`prepare_qk`); v: [B, T, H, dv]; g, beta: [B, T, H];
    state: [B, H, dk, dv] float32 (not modified). `history`, if given ([B, >=T, H, dk, dv]),
    receives the state after every position, in place; `records` ([B, >=T, H, dk + dv + 1])
    every token's update (`delta_rule`).
    Returns (out [B, T, H, dv] float32, final state [B, H, dk, dv])."""
    v, g, beta = v.float(), g.float(), beta.float()
    outs = []
    for t in range(q.shape[1]):
        state, out = delta_rule(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], None if records is None else records[:, t])
        outs.append(out)
        if history is not None:
            history[:, t].copy_(state)
    return torch.stack(outs, dim=1), state


def tree_gated_delta(q, k, v, g, beta, state, parents: torch.Tensor, history: torch.Tensor):
    """The gated delta rule over the nodes of a draft tree (qfd.tree) instead of a sequence:
    node 0 (the root) continues `state`, node t > 0 continues its parent's state, read back
    from `history`. Same arguments as `recurrent_gated_delta` with T = N nodes (parents come
    first); parents [N] long (a tensor: a CUDA graph replays any tree). history [B, >=N, H, dk,
    dv] receives every node's state, in place. Returns out [B, N, H, dv] float32."""
    v, g, beta = v.float(), g.float(), beta.float()
    outs = []
    for t in range(q.shape[1]):
        before = state if t == 0 else history.index_select(1, parents[t : t + 1])[:, 0]
        after, out = delta_rule(before, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(out)
        history[:, t].copy_(after)
    return torch.stack(outs, dim=1)


def tree_structure(ancestors: torch.Tensor, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From a tree's ancestor mask [N, N] (qfd.tree): parents [N] (-1 for the root) and, per
    node, the conv window columns of its `kernel` inputs, oldest first [N, kernel]. Window
    columns 0..kernel-2 hold the conv state (the last committed inputs), column kernel-1+j
    tree node j; a node's inputs are its ancestors' (and its own), then the state's."""
    n = ancestors.shape[0]
    depth = ancestors.sum(1) - 1  # the root has only itself
    node = torch.arange(n, device=ancestors.device)
    columns = []
    for back in range(kernel - 1, -1, -1):
        want = depth - back  # the depth of the input `back` steps up the path
        match = ancestors & (depth[None, :] == want[:, None])  # at most one ancestor per depth
        found = (match.long() * node[None, :]).sum(1)
        columns.append(torch.where(match.any(1), kernel - 1 + found, kernel - 1 + want))
    conv_index = torch.stack(columns, dim=1)
    parents = torch.where(depth > 0, conv_index[:, -2] - (kernel - 1), -1)
    return parents, conv_index


CHUNK_KERNEL = True  # bench_steps.py turns it off to time the prefill as before, side by side
# QFD_GDN_WINDOW=channels_last: a cached forward's conv window in channels-last memory
# (`GatedDeltaNet._window`; the step kernels read either layout through its strides). Measured on
# the H100 (docs/benchmarks.md, twenty-first session): the copy that builds a 16-token verify's
# window halves (89 -> 44 us a step, compiled), but the step kernel is 10-13% slower (verify
# 518 -> 567 us, decode 118 -> 133; its sm_90 SASS moves the loaded taps through shared memory
# to the conv's layout, and computes more exponentials): no net gain, so channels first stays.
CHANNELS_LAST_WINDOW = os.environ.get("QFD_GDN_WINDOW", "channels_first") == "channels_last"


def chunked_gated_delta(q, k, v, g, beta, state, chunk_size: int = 64):
    """Chunkwise gated delta rule (same arguments and results as `recurrent_gated_delta`,
    no history): inside a chunk the delta-rule updates are folded into one triangular solve
    (the WY / UT transform), across chunks the state is carried sequentially. On a GPU with
    flash-linear-attention installed its fused kernels do it (`qfd.kernels.gdn_fla`; if they
    fail on this GPU / Triton, qfd's own form from then on, with a warning)."""
    if gdn_fla.takes(q):
        return launch_or_fallback("flash-linear-attention chunk_gated_delta_rule", lambda: gdn_fla.chunked_gated_delta(q, k, v, g, beta, state),
                                  lambda: chunked_gated_delta_qfd(q, k, v, g, beta, state, chunk_size))
    return chunked_gated_delta_qfd(q, k, v, g, beta, state, chunk_size)


def chunked_gated_delta_qfd(q, k, v, g, beta, state, chunk_size: int = 64):
    """`chunked_gated_delta` in qfd's own code: batched torch ops inside the chunks, the walk
    across chunks in one Triton kernel where it runs (`gdn_chunk_triton`), else a torch loop."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # [B, H, T, d]
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()  # [B, H, T]
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk_size
    q, k, v = (x.reshape(B, H, n, chunk_size, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk_size), beta.reshape(B, H, n, chunk_size)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # log decay from the chunk start to each position
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular after the solve
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    args = (k_cumdecay, new_values, q, k, intra, cum[..., -1].exp(), state)
    if CHUNK_KERNEL and gdn_chunk_triton.kernel_takes(k_cumdecay, new_values):  # one launch, not ~9 per chunk
        out, state = gdn_chunk_triton.chunk_recurrence_triton(*args, fallback=lambda: chunk_recurrence(*args))
    else:
        out, state = chunk_recurrence(*args)
    out = out.reshape(B, H, -1, dv)[:, :, :T].transpose(1, 2)
    return out, state


def chunk_recurrence(k_cumdecay, new_values, q_scaled, k_scaled, intra, chunk_decay, state):
    """`chunked_gated_delta`'s walk across chunks ([B, H, n, C, d] float32, chunk_decay
    [B, H, n]): per chunk the values corrected by the entering state, the chunk's outputs and
    the state it hands on. Returns (outputs [B, H, n, C, dv], final state)."""
    state = state.float()
    out = torch.empty_like(new_values)
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q_scaled[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i, None, None] + k_scaled[:, :, i].transpose(-1, -2) @ v_new
    return out, state


def conv_and_gates(window, conv_weight, a, b, A_log, dt_bias, dims: tuple[int, int, int, int], dtype):
    """From the conv window and the a/b projections to the gated delta rule's inputs.

    window [B, C, K-1+T] (the conv state then the T new tokens' q/k/v channels); conv_weight
    [C, 1, K]; a, b [B, T, H]; dims (k heads, dk, v heads, dv). Depthwise conv + SiLU (rounded
    to `dtype` as transformers' module does), split into heads, q/k repeated to the value heads
    and prepared (`prepare_qk`), decay g = -exp(A_log) * softplus(a + dt_bias) and strength
    beta = sigmoid(b). Returns q, k [B, T, H, dk] float32, v [B, T, H, dv], g [B, T, H]
    float32, beta [B, T, H]."""
    k_heads, dk, v_heads, dv = dims
    B, T = a.shape[:2]
    conv = F.silu(F.conv1d(window.to(conv_weight.dtype), conv_weight, groups=conv_weight.shape[0]))
    conv = conv.to(dtype).transpose(1, 2)  # [B, T, C]
    q, k, v = torch.split(conv, [k_heads * dk, k_heads * dk, v_heads * dv], dim=-1)
    q, k = q.reshape(B, T, k_heads, dk), k.reshape(B, T, k_heads, dk)
    v = v.reshape(B, T, v_heads, dv)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    if v_heads > k_heads:
        rep = v_heads // k_heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k = prepare_qk(q, k)
    return q, k, v, g, beta


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * SiLU(z) over the value-head dim (transformers' Qwen3_5RMSNormGated), x
    first cast to z's dtype (the core output arrives in float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return norm_triton.norm(x, self.weight, self.eps, norm_triton.GATED, gate)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer; parameter names mirror transformers'."""

    def __init__(self, cfg):
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.in_proj_qkv = Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        # the four in_proj_* as one linear, set by qfd.models.fuse after loading (runtime only)
        self.in_proj: nn.Module | None = None
        self.in_proj_sizes: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor, state=None, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]. `state`: this layer's `GDNState` in the cache
        (updated in place, with what rollback needs recorded), or None for a fresh sequence.
        tree: (parents [T], conv_index [T, K]) from `tree_structure`: the T tokens are the
        nodes of a draft tree (qfd.tree), each continuing its parent; `state.keep_tree_node`
        then keeps one node's state."""
        B, T, _ = x.shape
        if self.in_proj is None:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        else:
            mixed, z, b, a = torch.split(self.in_proj(x), self.in_proj_sizes, dim=-1)
        dims = (self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)
        if tree is None and gdn_fla.takes_prompt(mixed, getattr(state, "max_verify", 16)):
            core = launch_or_fallback("flash-linear-attention prompt (conv + chunk rule)", lambda: self._prompt_fla(mixed, a, b, state, dims),
                                      lambda: self._prompt_qfd(self._window(mixed, state), a, b, state, dims, x.dtype))
            return self._output(core, z, x.dtype)
        window = self._window(mixed, state)
        if tree is not None:
            # each node's conv sees its own K inputs along its path: one window per node
            parents, conv_index = tree
            nodes = window[:, :, conv_index].permute(0, 2, 1, 3).reshape(B * T, self.conv_dim, self.kernel)
            q, k, v, g, beta = conv_and_gates(nodes, self.conv1d.weight, a.reshape(B * T, 1, -1), b.reshape(B * T, 1, -1), self.A_log, self.dt_bias, dims, x.dtype)
            q, k, v, g, beta = (t.reshape(B, T, *t.shape[2:]) for t in (q, k, v, g, beta))
            core = state.advance_tree(window, conv_index, q, k, v, g, beta, parents)
        elif state is not None and state.takes_window(window):
            # decode / verify on a GPU: conv, gates and recurrence in one kernel
            core = state.advance_window(window, self.conv1d.weight, a, b, self.A_log, self.dt_bias, self.num_k_heads)
        else:
            core = self._prompt_qfd(window, a, b, state, dims, x.dtype)
        return self._output(core, z, x.dtype)

    def _window(self, mixed: torch.Tensor, state) -> torch.Tensor:
        """The conv's input [B, C, K-1+T]: the conv state (zeros for a fresh sequence), then the
        T tokens' q/k/v channels (`mixed` [B, T, C]). Under QFD_GDN_WINDOW=channels_last its
        memory is [B, K-1+T, C] (a transposed view): the copy that builds it reads the
        projection's rows whole instead of each token's channels C apart, and the step kernels
        read each tap's channels contiguously (CHANNELS_LAST_WINDOW says what it measured)."""
        if state is None:
            return F.pad(mixed.transpose(1, 2), (self.kernel - 1, 0))
        if not CHANNELS_LAST_WINDOW:
            return torch.cat([state.conv.to(mixed.dtype), mixed.transpose(1, 2)], dim=-1)
        return torch.cat([state.conv.to(mixed.dtype).transpose(1, 2), mixed], dim=1).transpose(1, 2)

    def _output(self, core: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        """Gated RMSNorm of the core output [B, T, H, dv] by z, then out_proj."""
        B, T = core.shape[:2]
        core = self.norm(core, z.reshape(B, T, self.num_v_heads, self.head_v_dim).to(dtype))
        return self.out_proj(core.reshape(B, T, self.value_dim))

    def _prompt_qfd(self, window, a, b, state, dims, dtype) -> torch.Tensor:
        """A forward outside the decode / verify kernels: conv and gates in torch, then the
        chunked form (fresh sequence) or the state's `advance`. Returns [B, T, H, dv]."""
        q, k, v, g, beta = conv_and_gates(window, self.conv1d.weight, a, b, self.A_log, self.dt_bias, dims, dtype)
        if state is None:
            zero = q.new_zeros(q.shape[0], self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32)
            return chunked_gated_delta(q, k, v, g, beta, zero)[0]
        return state.advance(window, q, k, v, g, beta)

    def _prompt_fla(self, mixed, a, b, state, dims) -> torch.Tensor:
        """A prompt on a GPU through flash-linear-attention: its causal conv reads the channels
        last, as the fused projection writes them (no transposed window copy, no cuDNN depthwise
        conv), and its chunk rule normalises q/k and shares each key head across its value heads
        in-kernel (no float32 q/k copies, no repeat). Through a cache the conv input is the conv
        state then the tokens ([B, K-1+T, C], one plain copy); its transpose is the window the
        state records for a rollback, which recomputes the torch inputs it needs. Returns
        [B, T, H, dv]."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        beta = b.sigmoid()
        if state is None:
            zero = mixed.new_zeros(mixed.shape[0], self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32)
            return gdn_fla.prompt_conv_and_rule(mixed, 0, self.conv1d.weight, g, beta, zero, dims)[0]
        kernel_minus_1 = self.kernel - 1
        channels_last = torch.cat([state.conv.to(mixed.dtype).transpose(1, 2), mixed], dim=1)
        out, final = gdn_fla.prompt_conv_and_rule(channels_last, kernel_minus_1, self.conv1d.weight, g, beta, state.recurrent, dims)
        window = channels_last.transpose(1, 2)  # [B, C, K-1+T], a view
        dtype = mixed.dtype

        def inputs_for(keep: int):  # the torch path's (q, k, v, g, beta) of the first `keep` tokens
            return conv_and_gates(window[..., : keep + kernel_minus_1], self.conv1d.weight, a[:, :keep], b[:, :keep], self.A_log, self.dt_bias, dims, dtype)

        state.record_forward(window, final, inputs_for)
        return out
