"""Where a decoding step's time goes: target-only, chain and draft-tree speculative steps of the
real Engine, split into phases (drafter, tree build, target verify, keep / rollback, context
append, ...) on held-out GSM8K prompts.

Each phase is timed with the device synchronised before and after it, so a phase's figure is
its GPU time plus its own launch and host cost, and "host, between phases" is the rest of the
step: Python bookkeeping (verdicts, commits, detokenising) during which the GPU has nothing to
do. The syncs add a little to every step; the "step, not instrumented" row (the same prompts
run again without them, same engine) is the true cost, and the table prints both.

    python bench/bench_step_phases.py --target smollm2-135m --drafter DIR [--prompts test.jsonl]
        [--num 4] [--max-new-tokens 256] [--trees 32] [--compile] [--profile] [--device cuda] [--out phases.json]

--profile adds the kernels of one replay of each graphed step of the chain engine - the target's
decode and 16-token verify, the drafter's draft and context append - after its run
(bench_steps.kernel_profile: time and launches per step, top kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_e2e import prompts_from  # noqa: E402


class PhaseClock:
    """Accumulated seconds per phase; `wrap` times a callable with syncs around it."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.seconds[name(*args, **kwargs) if callable(name) else name] += time.perf_counter() - start
            return out

        return timed


class _Forward:
    """The engine's target forward with its call timed (and its tree verify, when set)."""

    def __init__(self, inner, call):
        self._inner, self._call = inner, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def instrumented(engine, clock: PhaseClock):
    """Every phase of `engine`'s steps timed by `clock` while inside."""
    import qfd.engine
    import qfd.tree

    def forward_kind(ids, *_, last_only=False, **__):
        # the prompt's forward wants only its last logits (Engine.run); steps want every row
        return "prefill" if last_only else "target decode" if ids.shape[1] == 1 else "target verify (chain)"

    with ExitStack() as stack:
        forward = _Forward(engine.forward, clock.wrap(forward_kind, engine.forward))
        if hasattr(engine.forward, "verify_tree"):
            forward.verify_tree = clock.wrap("target verify (tree)", engine.forward.verify_tree)
        stack.enter_context(patched(engine, "forward", forward))
        # instance attributes shadow the cache's methods; removed again on exit
        for method, label in (("rollback", "target rollback"), ("keep_tree_path", "target keep tree path")):
            setattr(engine.cache, method, clock.wrap(label, getattr(engine.cache, method)))
            stack.callback(delattr, engine.cache, method)
        if engine.draft_step is not None:
            stack.enter_context(patched(engine, "draft_step", clock.wrap("drafter draft", engine.draft_step)))
        elif engine.drafter is not None:
            stack.enter_context(patched(engine.drafter, "draft", clock.wrap("drafter draft", engine.drafter.draft)))
        if engine.append_step is not None:
            stack.enter_context(patched(engine, "append_step", clock.wrap("drafter append", engine.append_step)))
        elif engine.drafter is not None:
            # start 0: the prompt's taps, appended before the first step (part of the time to first token)
            label = lambda cache, taps, start, *_: "drafter append" if start else "prefill"  # noqa: E731
            stack.enter_context(patched(engine.drafter, "append_context", clock.wrap(label, engine.drafter.append_context)))
        stack.enter_context(patched(qfd.engine, "verify", clock.wrap("host: chain verdict", qfd.engine.verify)))
        # tree_step imports these from qfd.tree at each call
        for fn, label in (("build_tree", "host: build tree"), ("pad_tree", "host: build tree"), ("tree_inputs", "tree inputs to device"), ("walk_greedy", "host: walk tree")):
            stack.enter_context(patched(qfd.tree, fn, clock.wrap(label, getattr(qfd.tree, fn))))
        yield


def measure(engine, prompt_ids, max_new: int, device) -> dict:
    """Per-step milliseconds by phase (instrumented run) and the step cost without the syncs."""
    from qfd.engine import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new)
    engine.generate(prompt_ids[0], GenerationConfig(max_new_tokens=16))  # warm-up

    def run():
        steps, decode_s, tokens, taus = 0, 0.0, 0, []
        for ids in prompt_ids:
            stats = engine.generate(ids, config).stats
            steps, decode_s, tokens = steps + stats.steps, decode_s + stats.total_s - stats.ttft_s, tokens + stats.new_tokens
            taus.append(stats.tau)
        return steps, decode_s, tokens, sum(taus) / len(taus)

    plain_steps, plain_s, tokens, tau = run()
    clock = PhaseClock(device)
    with instrumented(engine, clock):
        steps, decode_s, _, _ = run()
    clock.seconds.pop("prefill", None)  # in the time to first token, not in a step
    phases = {name: 1e3 * s / steps for name, s in sorted(clock.seconds.items())}
    phases["host, between phases"] = 1e3 * decode_s / steps - sum(phases.values())
    return {"phases_ms": phases, "step_instrumented_ms": 1e3 * decode_s / steps, "step_ms": 1e3 * plain_s / plain_steps, "tau": tau, "tokens": tokens, "decode_tokens_per_s": tokens / plain_s}


def step_profiles(engine, device) -> dict:
    """Kernel profiles of one call of each of the engine's steps, on its caches as the last
    generation left them (the target's calls are rolled back after each: same work every call)."""
    from bench_steps import kernel_profile

    cache, start = engine.cache, engine.cache.length
    block = torch.zeros(1, engine.verify_len, dtype=torch.long, device=device)

    def target(ids):
        def call():
            engine.forward(ids, cache, tap_layers=engine.tap_layers)
            cache.rollback(start)

        return call

    out = {"target decode": kernel_profile(target(block[:, :1]), device), f"target verify {engine.verify_len}": kernel_profile(target(block), device)}
    if engine.draft_step is not None:
        context = engine.draft_cache.length
        out["drafter draft"] = kernel_profile(lambda: engine.draft_step(1, context), device)
        if engine.append_step is not None:
            width = engine.drafter.cfg.target_hidden_size * len(engine.tap_layers)
            taps = torch.zeros(1, engine.verify_len, width, dtype=next(engine.drafter.parameters()).dtype, device=device)
            out["drafter append"] = kernel_profile(lambda: engine.append_step(taps, context - engine.verify_len), device)
    return out


def print_profiles(profiles: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    for step, prof in profiles.items():
        t = Table(title=f"{step}: {prof['kernel_us_per_step']:.0f} us of kernels in {prof['kernels_per_step']:.0f} launches per call (top kernels)")
        for col in ("kernel", "us / call", "calls"):
            t.add_column(col, justify="right" if col != "kernel" else "left")
        for r in prof["top"][:12]:
            t.add_row(r["name"][:90], f"{r['us_per_step']:.1f}", f"{r['calls_per_step']:.0f}")
        Console().print(t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl")
    p.add_argument("--num", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--trees", default="32", help="comma-separated tree sizes N (0 or empty: none)")
    p.add_argument("--compile", action="store_true", help="torch.compile the fixed-shape steps (Engine(compile_steps=True))")
    p.add_argument("--profile", action="store_true", help="also the kernels of one call of each of the chain engine's steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("bench_step_phases.json"))
    args = p.parse_args()

    from rich.console import Console
    from rich.table import Table

    from qfd.checkpoint import resolve_model
    from qfd.engine import Engine
    from qfd.models.drafter_io import load_drafter
    from qfd.models.loading import load_target

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, tokenizer = load_target(resolve_model(args.target).path, device, dtype)
    drafter = load_drafter(Path(args.drafter), device=device, dtype=dtype, fuse=True)
    probe = Engine(target, tokenizer, max_len=args.max_len)
    prompt_ids = [probe.encode([{"role": "user", "content": q}]) for q in prompts_from(args.prompts, args.num)]
    del probe

    systems = {"target-only": {}, "chain": {"drafter": drafter}}
    systems |= {f"tree {n}": {"drafter": drafter, "tree_size": n} for n in (int(t) for t in args.trees.split(",") if t.strip()) if n}
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "compile": args.compile, "num": args.num, "max_new_tokens": args.max_new_tokens, "systems": {}}
    for name, engine_args in systems.items():
        engine = Engine(target, tokenizer, max_len=args.max_len, compile_steps=args.compile, **engine_args)
        results["systems"][name] = measure(engine, prompt_ids, args.max_new_tokens, device)
        if args.profile and name == "chain":
            results["profiles"] = step_profiles(engine, device)
        args.out.write_text(json.dumps(results, indent=2))  # after every system: a cut run keeps what it has
        del engine

    rows = results["systems"]
    table = Table(title=f"ms per step by phase, {args.num} GSM8K test prompts x {args.max_new_tokens} tokens, {results['device']}{', compiled' if args.compile else ''} (each phase synced before and after)")
    table.add_column("phase")
    for name in rows:
        table.add_column(name, justify="right")
    phases = sorted({ph for r in rows.values() for ph in r["phases_ms"]}, key=lambda ph: (ph.startswith("host"), ph))
    for ph in phases:
        table.add_row(ph, *(f"{r['phases_ms'][ph]:.3f}" if ph in r["phases_ms"] else "" for r in rows.values()))
    table.add_row("step, instrumented", *(f"{r['step_instrumented_ms']:.3f}" for r in rows.values()))
    table.add_row("step, not instrumented", *(f"{r['step_ms']:.3f}" for r in rows.values()))
    table.add_row("tau", *(f"{r['tau']:.2f}" for r in rows.values()))
    table.add_row("decode tokens/s", *(f"{r['decode_tokens_per_s']:.1f}" for r in rows.values()))
    Console().print(table)
    print_profiles(results.get("profiles", {}))


if __name__ == "__main__":
    main()
