"""Step costs at a target's shape (default Qwen3.5-4B, random weights) and the projected
speedup of INT4 + DFlash speculative decoding over BF16 target-only decoding.

Random weights give exact step COSTS (kernels do not care what the numbers are), not
acceptance: the speedup printed is a PROJECTION at a given tau (default the paper's 5.03),

    T_base(in, out) = prefill_bf16(in) + out * decode_bf16
    T_spec(in, out) = prefill_int4(in) + ceil(out / tau) * (draft + verify_int4 + rollback + append)
    speedup = T_base / T_spec

with every term measured here in one run (CUDA graphs for decode / verify / draft / context
append on CUDA). The projection is printed as a ledger like the paper's Table 2, per latency
setting: BF16 target-only -> INT4 target -> + drafter (bf16, full attention) -> + INT4 drafter
(RTN group 128, the GPTQ layout) -> + SWA drafter (W = 1024), the drafter timed at each
setting's prompt length as context.

    python bench/bench_steps.py --device cuda [--shape qwen3.5-4b|tiny] [--tau 5.03] [--draft-len K] [--compile] [--int4-kernel triton]
        [--no-fuse] [--int4-head] [--settings short,medium,long] [--out steps.json]

--draft-len K times a step that drafts K <= B-1 tokens (the drafter's LM head over K slots)
and verifies K+1 (Engine(draft_len=K)); the default is the whole block. On a CPU see also
bench/bench_cpu_draft_len.py, which sweeps K on the embedded model. --compile torch.compiles
every fixed-shape step (decode, verify, draft) before its CUDA-graph capture (Engine(compile_steps=True)).
--no-compile-drafter leaves the drafter's steps uncompiled (fewer compiles); add
--compile-final-drafter to time the last ledger drafter (INT4, W = 1024) compiled too, as a
last ledger row ("+ drafter steps compiled": the draft and the append); --draft-vocab N that drafter once more with its LM
head over N ids (as `--draft-vocab N` serves it), one more row at the same tau (an assumption:
what a smaller draft vocabulary costs in acceptance is the model's; the mean speedup leaves it out).
The targets' same-input projections are fused as load_target fuses them (qfd.models.fuse);
--no-fuse (or QFD_FUSE=0) times the unfused model. --int4-head quantizes the INT4 target's LM
head too (qfd.quant.head, as load_target(int4_head=True)); the BF16 target keeps its own.
--int8-head: the INT4 target's LM head in INT8 instead (load_target(int8_head=True)).
--tree N also times a draft-tree verify of N tokens (qfd.tree; Engine(tree_size=N)) and the
keep of its deepest path, per setting ("tree_verify_keep"), for both targets: a random tree
of the drafter's shape (B-1 slots, top 8), depth-first as the engine lays it out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qfd.engine import GRAPHED_PREFILL_MAX_TOKENS, PREFILL_CHUNK  # noqa: E402
from qfd import kernels  # noqa: E402
from qfd.kernels import attention_triton, gdn_fla, gdn_triton, gdn_verify_triton  # noqa: E402
from qfd.draft_vocab import DraftVocabHead  # noqa: E402
from qfd.kernels.int4_configs import BLOCK_M_32, MAGIC_DOT, MMA16, MMA16_ONE_ROW, PDL_LAUNCH, W_FIRST_DOT  # noqa: E402
from qfd.models import cache as target_cache  # noqa: E402
from qfd.models import gdn as gdn_module  # noqa: E402
from qfd.models.drafter import DFlashDrafter, config_for_target  # noqa: E402
from qfd.models.fuse import fuse_projections, fusion_enabled, gated_mlp_enabled  # noqa: E402
from qfd.kernels import attention_inputs_triton, norm_triton  # noqa: E402
from qfd.models.graphs import StaticAppendStep, StaticDraftStep, StaticTargetSteps  # noqa: E402
from qfd.models.target import TargetConfig, TargetModel  # noqa: E402
from qfd.quant import int4_linear  # noqa: E402
from qfd.quant.int4_linear import CUDA_KERNELS, cuda_kernel_choice, one_row_kernel  # noqa: E402

QWEN35_4B = {
    "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "max_position_embeddings": 32768,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
}
TINY = {**QWEN35_4B, "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
SETTINGS = {"short": (64, 128), "medium": (2048, 256), "long": (8192, 256)}


def timer(device):
    """median milliseconds of fn() over `iters` runs after `warmup`."""
    def measure(fn, iters=50, warmup=5):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return measure


def quantize_linears(model: torch.nn.Module, group_size: int, skip=("lm_head",), kernel: str | None = None) -> torch.nn.Module:
    """RTN INT4 of every nn.Linear whose input width the group size divides (the kernels' format;
    a GPTQ checkpoint has the same layout and cost, only other codes), with the dtype probe an
    INT4 checkpoint's loader gives each swapped linear (the drafter asks `fc.weight.dtype`).
    `kernel`: the CUDA INT4 kernel, "tinygemm" or "triton" (default: Int4Linear's)."""
    from qfd.quant.grid import rtn_quantize
    from qfd.quant.int4_linear import swap_int4_linears
    from qfd.quant.int4_load import give_dtype_probe

    dtype = next(model.parameters()).dtype
    qweights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in skip and module.in_features % group_size == 0:
            qweights[name] = rtn_quantize(module.weight.detach().float(), group_size, scale_dtype=dtype)
    swap_int4_linears(model, qweights, kernel=kernel)
    modules = dict(model.named_modules())
    for name in qweights:
        give_dtype_probe(modules[name], next(model.parameters()).device, dtype)
    return model


def build_target(shape: dict, device, dtype, int4: bool, group_size: int, kernel: str | None = None, fuse: bool = True, int4_head: bool = False, int8_head: bool = False) -> TargetModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = TargetModel(TargetConfig.from_hf(shape, "qwen3_5")).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.reset_rope(device)
    if int4:
        quantize_linears(model, group_size, kernel=kernel)
        if int4_head or int8_head:  # the tied embedding stays dense for the lookups
            from qfd.quant.head import quantize_head

            quantize_head(model, group_size, kernel=kernel, bits=8 if int8_head else 4)
    if fuse:  # after the INT4 swap, as load_target fuses after loading
        fuse_projections(model)
    return model.eval()


def random_tree(size: int, slots: int, device):
    """A draft tree of `size` nodes over `slots` draft slots from random drafter scores, and
    its deepest path (what a keep moves): tree_inputs + path."""
    from qfd.tree import build_tree, tree_inputs

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(slots, 8, generator=g).log_softmax(-1).sort(-1, descending=True).values
    tree = build_tree(1, torch.randint(2, 1000, (slots, 8), generator=g), scores, size)
    deepest = max(range(tree.size), key=lambda i: (tree.depths[i], -i))
    return tree_inputs(tree, device), tree.path_to(deepest)


def target_costs(model, max_len, block, measure, device, taps, compile_steps=False, settings=tuple(SETTINGS), profile=False, tree: int = 0) -> dict:
    """`block`: tokens per verify (draft length + 1); `settings`: which of SETTINGS to time;
    `profile`: also a kernel breakdown of the decode and the verify (`kernel_profile`);
    `tree`: also a tree verify of that many tokens + the keep of one path."""
    cache = model.new_cache(max_len, static=True, max_verify=max(16, block, tree))
    steps = StaticTargetSteps(model, cache, sizes=(1, block), tap_layers=taps, compile=compile_steps, tree_size=tree)
    out = {}
    with torch.inference_mode():
        for name, (n_in, _) in SETTINGS.items():
            if name not in settings or n_in + 300 > max_len:
                continue
            prompt = torch.randint(0, model.config.vocab_size, (1, n_in), device=device)

            def prefill():
                cache.reset()
                model(prompt, cache, tap_layers=taps, last_only=True)

            out[f"prefill_{name}_ms"] = measure(prefill, iters=5, warmup=1)
            if n_in > GRAPHED_PREFILL_MAX_TOKENS:  # side by side: the eager prefill as it was before 2026-12-05 (ninth session)
                with eager_prefill_as_before():
                    out[f"prefill_before_{name}_ms"] = measure(prefill, iters=3, warmup=1)
                if device.type == "cuda" and gdn_fla.BACKEND != "qfd" and gdn_fla.installed():  # and with qfd's own chunked GDN
                    with gdn_prefill_backend("qfd"):
                        out[f"prefill_qfd_gdn_{name}_ms"] = measure(prefill, iters=3, warmup=1)
                    if gdn_fla.PROMPT_CONV == "fla":  # and with qfd's conv and gates before the package's rule
                        with gdn_prefill_backend("fla"):
                            out[f"prefill_torch_conv_{name}_ms"] = measure(prefill, iters=3, warmup=1)
                    else:  # and with the package's conv too
                        with gdn_prefill_backend("fla_conv"):
                            out[f"prefill_fla_conv_{name}_ms"] = measure(prefill, iters=3, warmup=1)
            if n_in <= GRAPHED_PREFILL_MAX_TOKENS and block >= PREFILL_CHUNK:  # as the Engine serves a short prompt

                def prefill_chunked():
                    cache.reset()
                    steps.prefill(prompt, block)

                out[f"prefill_chunked_{name}_ms"] = measure(prefill_chunked, iters=5, warmup=1)
            one = torch.randint(0, model.config.vocab_size, (1, 1), device=device)
            blk = torch.randint(0, model.config.vocab_size, (1, block), device=device)

            prefill()
            L = cache.length

            def decode():  # advances the cache by one token per call (room: 300 positions)
                steps(one, cache, tap_layers=taps)

            def verify():  # verify a block, then reject it all (restores the block-start GDN state)
                steps(blk, cache, tap_layers=taps)
                cache.rollback(L)

            def verify_rollback():  # as verify, plus a partial-accept rollback first (per-position GDN restore)
                steps(blk, cache, tap_layers=taps)
                cache.rollback(L + block // 3)
                cache.rollback(L)

            out[f"verify_{name}_ms"] = measure(verify)
            out[f"verify_rollback_{name}_ms"] = measure(verify_rollback)
            if target_cache.ONE_LAUNCH_ROLLBACK and kernels.runs_on(blk):  # side by side: the GDN rollback as two copies per layer
                target_cache.ONE_LAUNCH_ROLLBACK = False
                try:
                    out[f"verify_rollback_per_layer_{name}_ms"] = measure(verify_rollback)
                finally:
                    target_cache.ONE_LAUNCH_ROLLBACK = True
            if tree:
                (ids, depths, ancestors), path = random_tree(tree, block - 1, device)

                def tree_verify_keep():  # then back to L (the states' values drift; the costs do not depend on them)
                    steps.verify_tree(ids, cache, depths, ancestors, taps)
                    cache.keep_tree_path(path)
                    cache.rollback(L)

                out[f"tree_verify_keep_{name}_ms"] = measure(tree_verify_keep)
            out[f"rollback_{name}_ms"] = max(0.0, out[f"verify_rollback_{name}_ms"] - out[f"verify_{name}_ms"])
            first = profile and "profile" not in out  # profile the first setting only
            if first:  # verify before decode: decode moves the cache past the verify's rollback point
                out["profile"] = {"verify": kernel_profile(verify, device)}
            out[f"decode_{name}_ms"] = measure(decode)
            if first:
                out["profile"]["decode"] = kernel_profile(decode, device)
    return out


@contextmanager
def eager_prefill_as_before():
    """A prompt's attention over the whole static cache in fp32 (grouped_attention) and the
    Gated DeltaNet chunks walked by the torch loop: the eager prefill before the ninth session."""
    import qfd.models.gdn
    import qfd.models.target

    saved = qfd.models.target.PROMPT_ATTENTION, qfd.models.gdn.CHUNK_KERNEL
    qfd.models.target.PROMPT_ATTENTION = qfd.models.gdn.CHUNK_KERNEL = False
    try:
        with gdn_prefill_backend("qfd"):
            yield
    finally:
        qfd.models.target.PROMPT_ATTENTION, qfd.models.gdn.CHUNK_KERNEL = saved


@contextmanager
def gdn_prefill_backend(name: str):
    """Long prompts' Gated DeltaNet meanwhile through `name` (qfd.kernels.gdn_fla): "qfd" (qfd's
    own chunked form), "fla" (the package's chunk rule after qfd's conv and gates), "fla_conv"
    (its conv too: QFD_GDN_PROMPT_CONV=fla)."""
    saved = gdn_fla.BACKEND, gdn_fla.PROMPT_CONV
    gdn_fla.BACKEND, gdn_fla.PROMPT_CONV = ("qfd", "torch") if name == "qfd" else ("auto", "fla" if name == "fla_conv" else "torch")
    try:
        yield
    finally:
        gdn_fla.BACKEND, gdn_fla.PROMPT_CONV = saved


def kernel_profile(fn, device, iters: int = 10, top: int = 25) -> dict:
    """Where a step's time goes: torch.profiler over `iters` calls, grouped by name. On CUDA the
    kernels (CUPTI traces the kernels inside a CUDA-graph replay too); on a CPU the ops' self
    times. Returns the summed time per step, the count per step and the `top` names by time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type.name == ("CUDA" if cuda else "CPU"):  # CUDA: kernels, memcpy, memset
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)) if cuda else e.self_cpu_time_total
            k[1] += 1
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {
        "kernel_us_per_step": sum(v[0] for v in kernels.values()) / iters,
        "kernels_per_step": sum(v[1] for v in kernels.values()) / iters,
        "top": [{"name": name[:120], "us_per_step": t / iters, "calls_per_step": c / iters} for name, (t, c) in rows[:top]],
    }


def drafter_costs(shape, embed, head, device, dtype, block, measure, contexts, num_drafts=None, compile_steps=False, group_size=128, kernel=None, out=None, on_update=None, fuse=True, compile_final=False, vocab_head=None, variants=None, compile_append=None, profile=False) -> dict:
    """One draft (StaticDraftStep) and one context append of a verify's k + 1 taps
    (StaticAppendStep, what the engine replays; `append_eager_*` the Python-launched one) for a
    5-layer drafter, bf16 and INT4 (RTN), full attention and a 1024-token window, per context.
    Fills `out` (returned) and calls `on_update()` after each variant; the ledger's three come
    first. `fuse`: k/v and gate/up stacked, as load_drafter(fuse=True) serves it.
    `compile_final` (with compile_steps off): the ledger's last drafter (INT4, W = 1024) once
    more with its draft step torch.compile'd (labels `int4_w1024_compiled_*`): one compile per
    context instead of one per variant and context.
    `vocab_head` (qfd.draft_vocab.DraftVocabHead, as `--draft-vocab N` serves it): the ledger's
    last drafter once more with it as its LM head (labels `int4_w1024_vocab_*`).
    `variants` [(precision, window, compiled, vocab head or None)] replaces that list;
    `compile_append` (None: as the draft) whether the append is compiled too.
    `profile`: also a kernel profile of the ledger's last drafter (`variants`' last) draft and
    append at the first context (`out["profile"]`)."""
    out = {} if out is None else out
    rows = (num_drafts or block - 1) + 1
    profiled = None if variants is None else variants[-1]
    if variants is None:  # the ledger's drafters in its order, then bf16 with a window
        final = [("int4", 1024, True, None)] if compile_final and not compile_steps else []
        vocab = [("int4", 1024, compile_steps or compile_final, vocab_head)] if vocab_head is not None else []
        ledger = [("bf16", None, compile_steps, None), ("int4", None, compile_steps, None), ("int4", 1024, compile_steps, None), *final, *vocab]
        variants, profiled = [*ledger, ("bf16", 1024, compile_steps, None)], ledger[-1]
    for precision, window, compiled, vocab in variants:
        cfg = config_for_target(shape, num_layers=5, block_size=block, sliding_window=window, mask_token_id=shape["vocab_size"] - 1)
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()
        if precision == "int4":
            quantize_linears(drafter, group_size, kernel=kernel)
        if fuse:
            fuse_projections(drafter)
        for context in contexts:
            cache = drafter.new_cache(context + 2 * block)
            taps = torch.randn(1, context, len(cfg.target_layer_ids) * cfg.target_hidden_size, device=device, dtype=dtype)
            with torch.inference_mode():
                drafter.append_context(cache, taps, 0)
            step = StaticDraftStep(drafter, cache, embed=embed, head=head if vocab is None else vocab, num_drafts=num_drafts, compile=compiled)
            append = StaticAppendStep(drafter, cache, rows=rows, compile=compiled if compile_append is None else compile_append)
            extra = "_vocab" if vocab is not None else "_compiled" if compiled and not compile_steps else ""
            label = f"{precision}_w{window or 'full'}{extra}_ctx{context}"
            out[f"draft_{label}_ms"] = measure(lambda: step(5, context), iters=20)
            new = taps[:, :rows]
            # both rewrite the last `rows` positions: the cache length stays `context`
            out[f"append_{label}_ms"] = measure(lambda: append(new, context - rows), iters=20)

            def append_eager():
                with torch.inference_mode():
                    drafter.append_context(cache, new, context - rows)

            out[f"append_eager_{label}_ms"] = measure(append_eager, iters=20)
            if profile and (precision, window, compiled, vocab) == profiled and context == contexts[0]:
                out["profile"] = {f"draft {label}": kernel_profile(lambda: step(5, context), device),
                                  f"append {label}": kernel_profile(lambda: append(new, context - rows), device)}
            del step, append, cache
        if on_update:
            on_update()
    return out


DRAFT_VOCAB_ROW = "+ draft vocabulary (tau assumed unchanged)"
# The paper's Table 2, one system per row, each adding one piece to the row above it.
LEDGER = (
    ("BF16 target-only", None),
    ("INT4 target", None),
    ("+ drafter (bf16, full attention)", ("bf16", "full")),
    ("+ INT4 drafter", ("int4", "full")),
    ("+ SWA drafter (W = 1024)", ("int4", "1024")),
    # only from runs with --compile-final-drafter (the rows above: drafter graphed, uncompiled)
    ("+ drafter steps compiled", ("int4", "1024_compiled")),  # the draft, and since 2026-12-06 the append
    # only from runs with --draft-vocab N: the row above with the drafter's LM head over N ids
    # (tau as given: what a smaller draft vocabulary costs in acceptance is the model's, not timed here)
    (DRAFT_VOCAB_ROW, ("int4", "1024_vocab")),
)


def drafter_ab(shape, embed, head, device, dtype, block, measure, contexts, compile_steps, num_drafts, group_size, kernel, fuse, out, on_update) -> dict:
    """The ledger's last drafter (INT4, W = 1024) before and after the two drafter changes of
    2026-12-06, side by side: its attention in torch (SDPA after a K/V copy per query head) with
    the append graphed, uncompiled - against the split-KV kernels with the append compiled too."""
    for name, split, compile_append in (("before", False, False), ("after", True, compile_steps)):
        attention_triton.SPLIT_KERNEL = split
        out[name] = drafter_costs(shape, embed, head, device, dtype, block, measure, contexts, num_drafts=num_drafts, compile_steps=compile_steps, group_size=group_size, kernel=kernel,
                                  fuse=fuse, variants=[("int4", 1024, compile_steps, None)], compile_append=compile_append)
        on_update()
    attention_triton.SPLIT_KERNEL = True
    return out


def final_system(rows: list[dict]) -> str | None:
    """The last LEDGER system every row has: the full system this run timed. The draft-vocabulary
    row is not one: its projection assumes the subset head keeps tau, which no step cost shows."""
    timed = [system for system, _ in LEDGER if rows and all(system in r for r in rows) and system != DRAFT_VOCAB_ROW]
    return timed[-1] if timed else None


def served_prefill(costs: dict, name: str) -> float:
    """The prefill the Engine would run: graphed chunks for a short prompt when timed, else eager."""
    return costs.get(f"prefill_chunked_{name}_ms", costs[f"prefill_{name}_ms"])


def ledger(results: dict, tau: float, settings) -> list[dict]:
    """Projected latency (ms) per setting of each LEDGER system, from the measured step costs:
    target-only = prefill + out * decode; speculative = INT4 prefill + ceil(out / tau) *
    (draft + INT4 verify + rollback + append) with the drafter costs at the prompt's context.
    The prefill is the one the Engine serves (`served_prefill`)."""
    b, q, d = results.get("bf16", {}), results.get("int4", {}), results.get("drafter", {})
    rows = []
    for name, (n_in, n_out) in SETTINGS.items():
        if name not in settings or f"decode_{name}_ms" not in b or f"decode_{name}_ms" not in q:
            continue
        row = {"setting": name}
        for system, drafter in LEDGER:
            if drafter is None:
                costs = b if system.startswith("BF16") else q
                row[system] = served_prefill(costs, name) + n_out * costs[f"decode_{name}_ms"]
                continue
            label = f"{drafter[0]}_w{drafter[1]}_ctx{n_in}"
            if f"draft_{label}_ms" not in d:  # a run cut short before this drafter: no row
                continue
            step = d[f"draft_{label}_ms"] + q[f"verify_rollback_{name}_ms"] + d[f"append_{label}_ms"]
            row[system] = served_prefill(q, name) + math.ceil(n_out / tau) * step
            row[f"{system} step_ms"] = step
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=("qwen3.5-4b", "tiny"), default="qwen3.5-4b")
    p.add_argument("--tau", type=float, default=5.03, help="acceptance length for the projection (paper: 5.03)")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--draft-len", type=int, default=None, help="drafts per step K (1..block-1; default block-1): verify K+1 tokens")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--compile", action="store_true", help="torch.compile the fixed-shape steps before CUDA-graph capture")
    p.add_argument("--int4-kernel", choices=CUDA_KERNELS, default=None, help="CUDA INT4 matmul kernel (default: $QFD_INT4_KERNEL, else Int4Linear's default)")
    p.add_argument("--no-fuse", action="store_true", help="keep the targets' q/k/v, gate/up and GDN in_proj_* linears separate (default: fused, as load_target does)")
    p.add_argument("--int4-head", action="store_true", help="the INT4 target's LM head in INT4 too (RTN, qfd.quant.head; default: bf16 head, as INT4 checkpoints ship it)")
    p.add_argument("--int8-head", action="store_true", help="the INT4 target's LM head in INT8 (group scales, qfd.quant.head.Int8Head, its Triton kernel)")
    p.add_argument("--profile", action="store_true", help="also profile the target's decode and verify (CUDA kernels / CPU ops; first setting)")
    p.add_argument("--reference-kernels", action="store_true", help="the torch GDN recurrence and the torch attention with a single attention-values GEMM instead of the fused GDN step kernel and the split-KV attention kernels (side-by-side runs)")
    p.add_argument("--no-fused-conv", action="store_true", help="the GDN step kernel without the conv/SiLU/normalisation/gates folded in (conv and gates in torch: the 2026-12-04 kernel; side-by-side runs)")
    p.add_argument("--tree", type=int, default=0, metavar="N", help="also time a draft-tree verify of N tokens + keeping one path (qfd.tree), per setting")
    p.add_argument("--targets-only", action="store_true", help="time the targets only (no drafter, no ledger)")
    p.add_argument("--no-compile-drafter", action="store_true", help="with --compile: compile the targets' steps only (the drafter's stay graphed, uncompiled; saves its compiles)")
    p.add_argument("--compile-final-drafter", action="store_true", help="also time the last drafter (INT4, W = 1024) with its draft step compiled, as one more ledger row (one compile per context): with --compile --no-compile-drafter, or without --compile (the targets' steps graphed, uncompiled - the Engine's default)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N", help="also time the last drafter with its LM head over N ids (--draft-vocab N when served), as one more ledger row at the same tau")
    p.add_argument("--drafter-ab", action="store_true", help="only the last drafter (INT4, W = 1024; compiled with --compile) at 64/1K/8K context: torch attention + graphed append vs the split-KV attention + compiled append, side by side")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated latency settings to time (default all: short,medium,long)")
    p.add_argument("--out", type=Path, default=Path("bench_steps.json"))
    p.add_argument("--report", type=Path, default=None, metavar="JSON", help="print the tables of a saved run (also one cut short) and exit")
    args = p.parse_args()
    if args.int4_head and args.int8_head:
        p.error("pass one of --int4-head or --int8-head")
    if args.report:
        results = json.loads(args.report.read_text())
        if "drafter_ab" in results:
            report_drafter_ab(results)
            return
        finish(results)
        report(results)
        return
    settings = tuple(s for s in args.settings.split(",") if s)
    if not settings or any(s not in SETTINGS for s in settings):
        p.error(f"--settings takes a comma-separated subset of {','.join(SETTINGS)}")
    draft_len = args.block - 1 if args.draft_len is None else args.draft_len
    if not 1 <= draft_len <= args.block - 1:
        p.error(f"--draft-len must be in 1..{args.block - 1}")
    verify_len = draft_len + 1
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = QWEN35_4B if args.shape == "qwen3.5-4b" else TINY
    measure = timer(device)
    if args.reference_kernels:
        import qfd.models.cache
        import qfd.models.target

        qfd.models.cache.FUSED_STEP = qfd.models.target.SPLIT_VALUES = attention_triton.SPLIT_KERNEL = False
    if args.no_fused_conv:
        import qfd.models.cache

        qfd.models.cache.FUSED_CONV = False
    if args.compile or args.compile_final_drafter:  # each size x drafter variant x context recompiles the same code object: room for all
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)
    # Room for the longest prompt plus the 300 positions the decode/verify timings advance
    # through (target_costs skips settings that do not fit: the tiny shape stops at medium).
    longest = 8192 if args.shape == "qwen3.5-4b" else 2048
    max_len = longest + 300 + 2 * args.block
    taps = config_for_target(shape, mask_token_id=0).target_layer_ids
    fuse = not args.no_fuse and fusion_enabled()

    results = {"settings": list(settings), "shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "tau": args.tau, "block": args.block, "draft_len": draft_len, "compile": args.compile, "compile_drafter": args.compile and not args.no_compile_drafter, "int4_kernel": cuda_kernel_choice(args.int4_kernel), "int4_magic_operand": MAGIC_DOT, "int4_block_m_32": BLOCK_M_32, "reference_kernels": args.reference_kernels, "fused": fuse, "int4_head": args.int4_head, "int8_head": args.int8_head, "fused_conv": not (args.no_fused_conv or args.reference_kernels), "tree": args.tree,
               # the switches read from the environment (gpu_kernels_ab.sh sets them per variant)
               "attention_kernel": "triton" if attention_triton.SPLIT_KERNEL else "torch", "gdn_verify": "chunk" if gdn_verify_triton.CHUNK_VERIFY else "loop", "int4_one_row": one_row_kernel(), "int4_prefetch": int4_linear.PREFETCH_NEXT, "gdn_prefetch": gdn_triton.PREFETCH, "gdn_rollback_one_launch": target_cache.ONE_LAUNCH_ROLLBACK,
               "int4_pdl": PDL_LAUNCH, "int4_w_first": W_FIRST_DOT, "int4_mma16": "all" if MMA16_ONE_ROW else MMA16, "draft_vocab": args.draft_vocab,
               "gated_mlp": gated_mlp_enabled(), "gdn_window": "channels_last" if gdn_module.CHANNELS_LAST_WINDOW else "channels_first", "fused_norm": norm_triton.setting(), "fused_add_norm": norm_triton.add_enabled(), "fused_qkv": attention_inputs_triton.enabled()}

    def save():  # after every section: a run cut short by its time limit still leaves its figures
        # Triton kernels that failed to compile or launch here ran their torch fallbacks: say so
        results["kernel_fallbacks"] = sorted(kernels._FAILED)
        args.out.write_text(json.dumps(results, indent=2))

    if args.drafter_ab:  # the INT4 target for its embedding and head only
        int4 = build_target(shape, device, dtype, int4=True, group_size=args.group_size, kernel=args.int4_kernel, fuse=fuse, int4_head=args.int4_head, int8_head=args.int8_head)
        results["drafter_ab"] = {}
        drafter_ab(shape, int4.embed, int4.head, device, dtype, args.block, measure, [64, 1024, 8192 if args.shape == "qwen3.5-4b" else 2048], args.compile, draft_len, args.group_size, args.int4_kernel, fuse, results["drafter_ab"], save)
        report_drafter_ab(results)
        return
    bf16 = build_target(shape, device, dtype, int4=False, group_size=args.group_size, fuse=fuse)
    results["bf16"] = target_costs(bf16, max_len, verify_len, measure, device, (), args.compile, settings, args.profile, args.tree)
    save()
    del bf16
    torch.cuda.empty_cache() if device.type == "cuda" else None
    int4 = build_target(shape, device, dtype, int4=True, group_size=args.group_size, kernel=args.int4_kernel, fuse=fuse, int4_head=args.int4_head, int8_head=args.int8_head)
    results["int4"] = target_costs(int4, max_len, verify_len, measure, device, taps, args.compile, settings, args.profile, args.tree)
    save()
    if args.targets_only:
        report(results)
        return
    # the prompts' contexts (the ledger), plus 1K and 8K (issue 9: SWA at 8K vs 1K)
    contexts = sorted({1024, 8192 if args.shape == "qwen3.5-4b" else 2048} | {SETTINGS[s][0] for s in settings})
    results["drafter"] = {}
    vocab_head = None
    if args.draft_vocab:  # which N ids does not change the cost: random ones (random weights have no frequencies)
        torch.manual_seed(1)
        vocab_head = DraftVocabHead.of_target(int4, torch.randperm(shape["vocab_size"], device=device)[: args.draft_vocab])
    drafter_costs(shape, int4.embed, int4.head, device, dtype, args.block, measure, contexts, num_drafts=draft_len, compile_steps=args.compile and not args.no_compile_drafter, group_size=args.group_size, kernel=args.int4_kernel, out=results["drafter"], on_update=save, fuse=fuse,
                  compile_final=args.compile_final_drafter, vocab_head=vocab_head, profile=args.profile)
    if device.type == "cuda":
        results["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    save()

    finish(results)
    save()
    report(results)


def finish(results: dict) -> None:
    """The ledger rows and the full system's mean projected speedup, from the step costs."""
    rows = ledger(results, results["tau"], results["settings"])
    results["ledger"] = rows
    final = final_system(rows)
    if final and final != LEDGER[0][0]:
        results["mean_speedup_spec"] = sum(r[LEDGER[0][0]] / r[final] for r in rows) / len(rows)
        results["full_system"] = final


def report_drafter_ab(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ab = results["drafter_ab"]
    table = Table(title=f"drafter (INT4, W = 1024{', compiled' if results['compile'] else ''}) step, ms ({results['device']}): before = torch attention + graphed append, after = split-KV attention + compiled append")
    for col in ("context", "draft before", "draft after", "x", "append before", "append after", "x", "draft + append: before -> after"):
        table.add_column(col, justify="right")
    for key in sorted((k for k in ab.get("after", {}) if k.startswith("draft_")), key=lambda k: int(k.rsplit("ctx", 1)[1][:-3])):
        context = key.rsplit("ctx", 1)[1][:-3]
        append_key = key.replace("draft_", "append_", 1)
        db, da = ab["before"][key], ab["after"][key]
        ab_, aa = ab["before"][append_key], ab["after"][append_key]
        table.add_row(context, f"{db:.3f}", f"{da:.3f}", f"{db / da:.2f}x", f"{ab_:.3f}", f"{aa:.3f}", f"{ab_ / aa:.2f}x", f"{db + ab_:.3f} -> {da + aa:.3f}")
    Console().print(table)


def report(results: dict) -> None:
    """Print the step-cost table, the ledger, the drafter's SWA ratios and the kernel profiles
    of a run (`--report JSON` re-prints a saved one, also one cut short: what it has)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if results.get("kernel_fallbacks"):
        console.print(f"[bold red]kernels that fell back to torch in this run: {', '.join(results['kernel_fallbacks'])}[/]")
    rows = results.get("ledger", [])
    final = final_system(rows) or LEDGER[-1][0]
    d = results.get("drafter", {})
    kind = f"{results['shape']}, {results['device']}, {results['draft_len']} drafts / {results['draft_len'] + 1}-token verify, INT4 {results['int4_kernel'] if results['device'] != 'cpu' else 'CPU kernel'}{', reference GDN/attention kernels' if results.get('reference_kernels') else ''}{', unfused projections' if results.get('fused') is False else ''}{', INT4 LM head' if results.get('int4_head') else ''}{', INT8 LM head' if results.get('int8_head') else ''}{', GDN conv/gates in torch' if results.get('fused_conv') is False else ''}{(', compiled' + ('' if results.get('compile_drafter', True) else ' targets (drafter uncompiled)')) if results['compile'] else ''}"
    steps = Table(title=f"step costs, ms ({kind})")
    for col in ("setting", "bf16 decode", "int4 decode", "int4 verify+rollback", "spec step (full system)", "step / int4 decode", "GDN rollback / step"):
        steps.add_column(col, justify="right")
    for r in rows:
        name = r["setting"]
        if f"{final} step_ms" not in r:
            continue
        step = r[f"{final} step_ms"]
        steps.add_row(name, *(f"{v:.3f}" for v in (results["bf16"][f"decode_{name}_ms"], results["int4"][f"decode_{name}_ms"], results["int4"][f"verify_rollback_{name}_ms"], step)),
                      f"{step / results['int4'][f'decode_{name}_ms']:.2f}", f"{results['int4'][f'rollback_{name}_ms'] / step:.1%}")
    if any(f"{final} step_ms" in r for r in rows):
        console.print(steps)
    target = Table(title=f"target step costs, ms ({kind})")
    for col in ("setting", "bf16 decode", "bf16 verify", "int4 decode", "int4 verify", "int4 verify+rollback", "int4 prefill (eager)", "int4 prefill (graphed chunks / eager as before)"):
        target.add_column(col, justify="right")
    for name in results["settings"]:
        keys = [(t, f"{step}_{name}_ms") for t, step in (("bf16", "decode"), ("bf16", "verify"), ("int4", "decode"), ("int4", "verify"), ("int4", "verify_rollback"), ("int4", "prefill"))]
        if all(k in results.get(t, {}) for t, k in keys):
            other = results["int4"].get(f"prefill_chunked_{name}_ms", results["int4"].get(f"prefill_before_{name}_ms"))
            target.add_row(name, *(f"{results[t][k]:.3f}" for t, k in keys), "-" if other is None else f"{other:.3f}")
    console.print(target)
    for t in ("bf16", "int4"):  # the one-launch GDN rollback beside the per-layer copies, same run
        for name in results["settings"]:
            per_layer = results.get(t, {}).get(f"verify_rollback_per_layer_{name}_ms")
            if per_layer is not None:
                one = results[t][f"verify_rollback_{name}_ms"]
                console.print(f"{t} {name}: verify + 2 GDN rollbacks {one:.3f} ms in one launch each, {per_layer:.3f} ms as two copies per layer ({per_layer / one:.2f}x)")
    prefill_forms = (("prefill", "eager (served for long prompts)"), ("prefill_qfd_gdn", "eager, qfd's own chunked GDN (not flash-linear-attention)"),
                     ("prefill_fla_conv", "eager, flash-linear-attention's conv too (QFD_GDN_PROMPT_CONV=fla)"),
                     ("prefill_torch_conv", "eager, qfd's conv before flash-linear-attention's rule (QFD_GDN_PROMPT_CONV=torch)"),
                     ("prefill_before", "eager as before 2026-12-05"), ("prefill_chunked", "graphed 16-token chunks (served for short prompts)"))
    prefill = Table(title=f"prefill, ms ({kind})")
    for col in ("setting", "target", *(label for _, label in prefill_forms)):
        prefill.add_column(col, justify="right")
    for name in results["settings"]:
        for t in ("bf16", "int4"):
            cells = [results.get(t, {}).get(f"{form}_{name}_ms") for form, _ in prefill_forms]
            if any(c is not None for c in cells):
                prefill.add_row(name, t, *("-" if c is None else f"{c:.1f}" for c in cells))
    console.print(prefill)
    if results.get("tree"):
        trees = Table(title=f"draft-tree verify of {results['tree']} tokens + keep of its deepest path, ms ({kind})")
        for col in ("setting", "bf16", "int4", f"int4 x its {results['draft_len'] + 1}-token verify+rollback"):
            trees.add_column(col, justify="right")
        for name in results["settings"]:
            if f"tree_verify_keep_{name}_ms" in results.get("int4", {}):
                b, q = results["bf16"][f"tree_verify_keep_{name}_ms"], results["int4"][f"tree_verify_keep_{name}_ms"]
                trees.add_row(name, f"{b:.3f}", f"{q:.3f}", f"{q / results['int4'][f'verify_rollback_{name}_ms']:.2f}")
        console.print(trees)
    table = Table(title=f"PROJECTED latency per setting, ms (x BF16 target-only), tau = {results['tau']}: a ledger like the paper's Table 2 ({kind})")
    table.add_column("system")
    for r in rows:
        table.add_column(f"{r['setting']} {'/'.join(map(str, SETTINGS[r['setting']]))}", justify="right")
    if rows:
        table.add_column("mean x", justify="right")
    for system, _ in LEDGER:
        if not any(system in r for r in rows):
            continue  # e.g. the compiled-drafter row of a run without --compile-final-drafter
        speedups = [r[LEDGER[0][0]] / r[system] if system in r else None for r in rows]
        cells = [f"{r[system]:.1f} ({x:.2f}x)" if x else "-" for r, x in zip(rows, speedups)]
        mean = [f"{sum(speedups) / len(speedups):.2f}x" if rows and all(speedups) else "-"] if rows else []
        table.add_row(system, *cells, *mean)
    if rows:
        console.print(table)
        console.print(f"target-only = prefill + out * decode; speculative = prefill_int4 + ceil(out / tau) * (draft + verify_int4 + rollback + append): a projection from measured step costs at the given tau, not an end-to-end run; the prefill is graphed chunks where the Engine uses them (prompts <= {GRAPHED_PREFILL_MAX_TOKENS} tokens), else eager")
    big = max([int(k.rsplit("ctx", 1)[1][:-3]) for k in d if k.startswith("draft_")] or [0])
    for precision in ("bf16", "int4"):
        if f"draft_{precision}_w1024_ctx{big}_ms" in d and f"draft_{precision}_wfull_ctx{big}_ms" in d:
            console.print(f"drafter ({precision}) draft at {big} vs 1024 context: full attention {d[f'draft_{precision}_wfull_ctx{big}_ms'] / d[f'draft_{precision}_wfull_ctx1024_ms']:.2f}x, W=1024 {d[f'draft_{precision}_w1024_ctx{big}_ms'] / d[f'draft_{precision}_w1024_ctx1024_ms']:.2f}x")
    console.print({k: round(v, 4) for k, v in {**d, **{f"bf16_{k}": v for k, v in results.get("bf16", {}).items()}, **{f"int4_{k}": v for k, v in results.get("int4", {}).items()}}.items() if isinstance(v, float)})
    for target in ("bf16", "int4", "drafter"):
        for step, prof in results.get(target, {}).get("profile", {}).items():
            t = Table(title=f"{target} {step}: {prof['kernel_us_per_step']:.0f} us of kernels in {prof['kernels_per_step']:.0f} launches per step (top kernels)")
            for col in ("kernel", "us / step", "calls / step"):
                t.add_column(col, justify="right" if col != "kernel" else "left")
            for r in prof["top"][:15]:
                t.add_row(r["name"][:70], f"{r['us_per_step']:.1f}", f"{r['calls_per_step']:.0f}")
            console.print(t)
    if results.get("mean_speedup_spec"):
        console.print(f"mean projected speedup of the full system ({results.get('full_system', LEDGER[-1][0])}): {results['mean_speedup_spec']:.2f}x")


if __name__ == "__main__":
    main()
