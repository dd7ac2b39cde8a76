"""The Gated DeltaNet step kernel (`qfd::gated_delta_conv_step`: conv, gates and the recurrence
of a decode / verify) alone at Qwen3.5-4B's layer shape, for a grid of launch splits side by
side: each program owns a [dk, BLOCK_V] slice of one head's state, NUM_WARPS warps, the token
loop, or (`--verify chunk`) the step's tokens in parallel
(`qfd.kernels.gdn_verify_triton`, the WY form); the token loop plain or with its loads issued
ahead (`--prefetch 0,1`: `gdn_triton.PREFETCH`, QFD_GDN_PREFETCH); the history as every
position's state or as per-token records (`--record states,records`: QFD_GDN_HISTORY). Every
config's output and states are checked against the served config's (max |difference|; for
records, every position's state as a rollback replays it from them).

Times: `bench_int4_kernels.graph_time_us` (20 calls captured in one CUDA graph, median of 15
replays), microseconds per call.

    python bench/bench_gdn_step.py [--tokens 1,16] [--block-v 8,16,32,64] [--warps 1,2,4,8] [--verify loop,chunk] [--prefetch 0,1] [--record states,records] [--out gdn_step.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_int4_kernels import graph_time_us  # noqa: E402
from qfd import kernels  # noqa: E402
from qfd.kernels import gdn_rollback_triton, gdn_triton, gdn_verify_triton  # noqa: E402
from qfd.models import cache as target_cache  # noqa: E402
K_HEADS, V_HEADS, DK, DV, KC = 16, 32, 128, 128, 4  # Qwen3.5-4B's linear attention


def layer_inputs(T: int, device):
    torch.manual_seed(0)
    C = 2 * K_HEADS * DK + V_HEADS * DV
    window = torch.randn(1, C, KC - 1 + T, device=device, dtype=torch.bfloat16)
    conv_weight = torch.randn(C, 1, KC, device=device, dtype=torch.bfloat16) * 0.5
    ab = torch.randn(1, T, 2 * V_HEADS, device=device, dtype=torch.bfloat16)
    a, b = ab[..., :V_HEADS], ab[..., V_HEADS:]  # strided views, as after the fused projection
    A_log, dt_bias = torch.randn(V_HEADS, device=device) * 0.1, torch.ones(V_HEADS, device=device)
    state = torch.randn(1, V_HEADS, DK, DV, device=device) * 0.1
    return window, conv_weight, a, b, A_log, dt_bias, state


def run_config(T, device, block_v, warps, chunk, prefetch, records=False):
    """(us per call, outputs, checks) of the op with this launch split (chunk: the parallel
    verify form; prefetch: the token loop's loads issued ahead; records: per-token records
    instead of the history, whose outputs then hold the positions' states replayed from them,
    and the checks the replay of all of them against the final state)."""
    split = gdn_verify_triton if chunk else gdn_triton  # the parallel form has its own split
    split.BLOCK_V, split.NUM_WARPS = block_v, warps
    gdn_verify_triton.CHUNK_VERIFY = chunk
    gdn_triton.PREFETCH = prefetch
    window, conv_weight, a, b, A_log, dt_bias, state0 = layer_inputs(T, device)
    state, start = state0.clone(), torch.empty_like(state0)
    history = torch.empty(1, max(T, 16), V_HEADS, *((DK + DV + 1,) if records else (DK, DV)), device=device)
    conv_state = torch.empty(1, window.shape[1], KC - 1, device=device, dtype=window.dtype)

    def step():
        state.copy_(state0)  # every call from the same state (a verify then a full rollback)
        return torch.ops.qfd.gated_delta_conv_step(window, conv_weight, a, b, A_log, dt_bias, state, start, history, conv_state, K_HEADS)

    out = step().clone()
    checks = {}
    if records:
        states = replayed_states(T, start, history)
        # a rollback's exactness: all T tokens replayed from the records = the step's own final state, bit for bit
        checks["replay_vs_own_final_state"] = float((states[:, T - 1] - state).abs().max())
    else:
        states = history
    # every position's state but the last (the state itself; the token loop does not store it)
    return graph_time_us(step), (out, state.clone(), states[:, : T - 1].clone()), checks


def replayed_states(T, start, records) -> torch.Tensor:
    """[1, T, H, DK, DV]: the state after each position as a rollback rebuilds it from the
    step's token records (gdn_rollback_triton's replay from the saved start)."""
    out = torch.empty(1, T, *start.shape[1:], device=start.device)
    for keep in range(1, T + 1):
        gdn_rollback_triton.replay(out[:, keep - 1], start, records, keep)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--block-v", default="8,16,32,64")
    p.add_argument("--warps", default="1,2,4,8")
    p.add_argument("--verify", default="loop,chunk", help="comma-separated: loop (token by token), chunk (the parallel WY form, 2-32 tokens)")
    p.add_argument("--prefetch", default="1", help="comma-separated: 0 (the plain token loop), 1 (its loads issued ahead; the loop form only)")
    p.add_argument("--record", default="states", help="comma-separated: states (every position's state, the history), records (per-token k, delta, decay; "
                   "QFD_GDN_HISTORY=records): the replayed states are compared with the served config's history")
    p.add_argument("--out", type=Path, default=Path("gdn_step.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gdn_step.py: needs a CUDA device")
    from rich.console import Console
    from rich.table import Table

    device = torch.device("cuda")
    loop_split, chunk_split = (gdn_triton.BLOCK_V, gdn_triton.NUM_WARPS), (gdn_verify_triton.BLOCK_V, gdn_verify_triton.NUM_WARPS)
    served = (*(chunk_split if gdn_verify_triton.CHUNK_VERIFY else loop_split), gdn_verify_triton.CHUNK_VERIFY, gdn_triton.PREFETCH, False)
    prefetches = [f != "0" for f in args.prefetch.split(",")]
    record_forms = [f == "records" for f in args.record.split(",")]

    def label(chunk, prefetch, records):  # the parallel form has no token loop to prefetch in, nor records
        return {"verify": "chunk" if chunk else "loop", "prefetch": None if chunk else prefetch, "record": "records" if records else "states"}

    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        kernels._FAILED.discard("gated_delta_conv_step")
        base_us, base, _ = run_config(T, device, *served)
        rows.append({"tokens": T, "block_v": served[0], "warps": served[1], **label(*served[2:]), "us": base_us, "served": True, "max_diff": 0.0})
        grid = itertools.product((int(v) for v in args.block_v.split(",")), (int(w) for w in args.warps.split(",")), (f == "chunk" for f in args.verify.split(",")), prefetches, record_forms)
        for bv, warps, chunk, prefetch, records in grid:
            if chunk and (prefetch != prefetches[0] or records or not gdn_verify_triton.MAX_TOKENS >= T > 1):
                continue  # the parallel form: once (no token loop, no records), for 2..32 tokens
            if (bv, warps, chunk) == served[:3] and (chunk or (prefetch, records) == served[3:]):
                continue
            kernels._FAILED.discard("gated_delta_conv_step")  # each split gets its own chance to compile
            what = f"T={T} block_v={bv} warps={warps} chunk={chunk} prefetch={prefetch} records={records}"
            try:
                us, got, checks = run_config(T, device, bv, warps, chunk, prefetch, records)
            except Exception as exc:  # a split the compiler rejects
                print(f"{what}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                continue
            if "gated_delta_conv_step" in kernels._FAILED:  # it fell back to torch: not this split's time
                print(f"{what}: the kernel failed (torch fallback), skipped", file=sys.stderr)
                continue
            parts = [float((g - w).abs().max()) if g.numel() else 0.0 for g, w in zip(got, base)]  # output, final state, the states before it (none at T = 1)
            rows.append({"tokens": T, "block_v": bv, "warps": warps, **label(chunk, prefetch, records), "us": us, "served": False, "max_diff": max(parts),
                         "max_diff_output_state_history": parts, **checks})
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))  # what a time limit leaves
    (gdn_triton.BLOCK_V, gdn_triton.NUM_WARPS), (gdn_verify_triton.BLOCK_V, gdn_verify_triton.NUM_WARPS) = loop_split, chunk_split
    gdn_verify_triton.CHUNK_VERIFY, gdn_triton.PREFETCH = served[2], served[3]
    if target_cache.RECORD_UPDATES:
        print("note: QFD_GDN_HISTORY=records is set, but the served row here records states (the baseline the records are checked against)")
    table = Table(title=f"GDN step kernel at Qwen3.5-4B's layer shape, us per call in a CUDA graph ({torch.cuda.get_device_name()})")
    for col in ("tokens", "verify", "prefetch", "history", "block_v", "warps", "us", "x served", "max |diff| vs served: output / final state / states before it"):
        table.add_column(col, justify="right")
    for r in rows:
        base_us = next(b["us"] for b in rows if b["tokens"] == r["tokens"] and b["served"])
        prefetch = "-" if r["prefetch"] is None else ("on" if r["prefetch"] else "off")
        table.add_row(str(r["tokens"]), r["verify"], prefetch, r["record"], str(r["block_v"]), str(r["warps"]), f"{r['us']:.1f}",
                      f"{base_us / r['us']:.2f}x" + (" (served)" if r["served"] else ""), " / ".join(f"{d:.1e}" for d in r.get("max_diff_output_state_history", [0.0] * 3)))
    Console(width=160).print(table)
    for r in rows:
        if "replay_vs_own_final_state" in r:
            print(f"T={r['tokens']} prefetch={r['prefetch']}: all tokens replayed from the records vs the step's own final state: max |diff| {r['replay_vs_own_final_state']:.1e}")


if __name__ == "__main__":
    main()
