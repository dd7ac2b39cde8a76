"""`qfd generate`: stream a target model's answer to the terminal."""

from __future__ import annotations

import typer

# Shared by generate, serve and eval (import-light: no torch here, so --help stays instant).
DRAFT_LEN_HELP = "Drafts verified per step (default B-1); shorter suits compute-bound CPUs."
DRAFT_LEN_AUTO_HELP = (DRAFT_LEN_HELP + " 'auto': time each k on this machine at start (a few seconds) and take the one of the "
                       "highest projected speedup, from the drafter's recorded acceptance.")
DRAFT_VOCAB_HELP = ("The drafter's LM head over only the N most frequent tokens of its training data (e.g. 8192): a cheaper "
                    "draft step on a CPU, the same output (the target verifies every token). Needs the drafter's "
                    "draft_vocab.safetensors (written by `qfd draft train`; add one with `qfd draft vocab`).")
SHORT_BLOCK_HELP = ("With --draft-len k: the drafter runs only the k + 1 block slots it verifies, not all B (a cheaper draft "
                    "step on a CPU; drafts from a block shape it was not trained on, so acceptance may drop; same output).")
TREE_HELP = ("Verify a tree of N tokens per step instead of a chain of draft-len + 1: the best-scoring paths over each "
             "draft slot's top 8 tokens (more accepted per step, same output; 0 = chain).")
COMPILE_HELP = "torch.compile the fixed-shape steps before CUDA-graph capture (GPU; slow first start)"
INT4_HEAD_HELP = ("quantize the target's LM head to INT4 (RTN g128) at load: fewer bytes per step, slightly different "
                  "target; see bench/bench_int4_head.py")
INT8_HEAD_HELP = ("quantize the target's LM head to INT8 (RTN g128) at load: half its bytes per step, logits ~4x closer "
                  "to the dense head's than --int4-head's; see bench/bench_int4_head.py --int8")


def register(app: typer.Typer, subapps: dict[str, typer.Typer]) -> None:
    @app.command()
    def generate(
        target: str = typer.Option(..., "--target", "-t", help="Target model: a directory, a hub id, or a built-in name (smollm2-135m)."),
        prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template (one user turn)."),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens to generate."),
        temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 = greedy."),
        top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
        top_k: int = typer.Option(0, "--top-k", help="Keep only the k most likely tokens (0 = off)."),
        seed: int = typer.Option(None, "--seed", help="Random seed for sampling."),
        device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N."),
        dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16."),
        drafter: str = typer.Option(None, "--drafter", "-d", help="DFlash drafter directory: speculative decoding (same output distribution, faster)."),
        allow_target_mismatch: bool = typer.Option(False, "--allow-target-mismatch", help="Use a drafter pinned to another target fingerprint (loud warning)."),
        draft_len: str = typer.Option(None, "--draft-len", help=DRAFT_LEN_AUTO_HELP, metavar="K|auto"),
        draft_vocab: int = typer.Option(None, "--draft-vocab", help=DRAFT_VOCAB_HELP),
        short_block: bool = typer.Option(False, "--short-block", help=SHORT_BLOCK_HELP),
        tree: int = typer.Option(0, "--tree", help=TREE_HELP, metavar="N"),
        compile_steps: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
        int4_head: bool = typer.Option(False, "--int4-head", help=INT4_HEAD_HELP),
        int8_head: bool = typer.Option(False, "--int8-head", help=INT8_HEAD_HELP),
    ) -> None:
        """Generate with the runtime target model, streaming tokens to stdout; stats go to stderr."""
        import sys

        from transformers.utils import logging as hf_logging

        from qfd.console import console
        from qfd.draft_len_auto import parse_draft_len
        from qfd.stages.generate import GenerateConfig, run

        hf_logging.set_verbosity_error()  # keep the terminal to the answer and our stats line

        cfg = GenerateConfig(target=target, prompt=prompt, chat=chat, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, device=device, dtype=dtype, drafter=drafter, allow_target_mismatch=allow_target_mismatch, draft_len=parse_draft_len(draft_len), draft_vocab=draft_vocab, short_block=short_block, tree=tree, compile_steps=compile_steps, int4_head=int4_head, int8_head=int8_head)
        result = run(cfg)
        sys.stdout.write("\n")  # end the streamed line before the stats (stderr)
        sys.stdout.flush()
        end = "stop token" if result.stopped else "max tokens"
        console.print(
            f"[dim]{len(result.tokens)} tokens ({end}), {result.tokens_per_s:.1f} tokens/s, "
            f"time to first token {result.ttft_s * 1000:.0f} ms, prompt {result.prompt_tokens} tokens[/dim]",
            highlight=False,
        )
        if result.tau is not None:
            rates = " ".join(f"{r:.2f}" for r in (result.accept_per_position or []))
            console.print(f"[dim]speculative: tau {result.tau:.2f} tokens/step, acceptance per draft position {rates}[/dim]", highlight=False)
