"""Tree verification (qfd.tree): the tree is the best-scoring set of paths, a tree verify's
logits at every node equal a plain forward over that node's path (attention and Gated
DeltaNet), the kept path leaves the cache as a fresh run would, and speculative output with a
tree stays the target's (greedy: token for token; sampling: in distribution)."""

from __future__ import annotations

import itertools

import pytest
import torch

from qfd.engine import Engine
from qfd.errors import QfdError
from qfd.models.graphs import StaticTargetSteps
from qfd.models.loading import load_target
from qfd.tree import DraftTree, build_tree, chain_tree, pad_tree, tree_inputs, walk_greedy
from tests.test_engine import OracleDrafter, assert_first_two_tokens_follow_the_target, greedy, make_drafter, prompt_ids

NEW = 40


@pytest.fixture(scope="module")
def targets(tiny_checkpoints):
    torch.set_num_threads(1)
    return {family: load_target(tiny_checkpoints[family], tokenizer=False)[0] for family in ("llama", "qwen3_5")}


@pytest.fixture(scope="module")
def llama(targets):
    return targets["llama"]


def path_ranks(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.ranks[i] for i in tree.path_to(node)[1:])


@pytest.mark.parametrize("size", [1, 2, 5, 13, 30])
def test_tree_holds_the_best_scoring_paths(size):
    depth, width = 4, 3
    scores = torch.randn(depth, width, generator=torch.Generator().manual_seed(size)).log_softmax(-1).sort(-1, descending=True).values
    candidates = torch.arange(depth * width).view(depth, width) + 100
    tree = build_tree(7, candidates, scores, size)
    assert tree.size == size and tree.tokens[0] == 7 and tree.parents[0] == -1
    assert all(tree.parents[i] < i for i in range(1, size))  # parents come first
    for node in range(size):  # depth-first: a node's best child follows it
        children = tree.children(node)
        assert not children or children[0] == node + 1
        assert [tree.ranks[c] for c in children] == sorted(tree.ranks[c] for c in children)
    every = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    score = lambda p: sum(float(scores[j, r]) for j, r in enumerate(p))  # noqa: E731
    best = sorted(every, key=score, reverse=True)[: size - 1]
    assert {path_ranks(tree, i) for i in range(1, size)} == set(best)
    for i in range(1, size):
        assert tree.depths[i] == len(path_ranks(tree, i))
        assert tree.tokens[i] == int(candidates[tree.depths[i] - 1, tree.ranks[i]])


def test_greedy_walk_follows_the_targets_choices():
    #        0 (root, token 5)
    #      /   \
    #   1 (7)  2 (8)
    #    |       |
    #   3 (9)  4 (6)
    tree = DraftTree(parents=(-1, 0, 0, 1, 2), depths=(0, 1, 1, 2, 2), ranks=(0, 0, 1, 0, 0), tokens=(5, 7, 8, 9, 6))
    choice = [8, 0, 6, 0, 3]  # target after root: 8 -> node 2; after node 2: 6 -> node 4; after 4: 3
    verdict = walk_greedy(tree, choice)
    assert verdict.path == [0, 2, 4] and verdict.tokens == [8, 6, 3] and verdict.accepted == 2
    assert walk_greedy(tree, [1, 0, 0, 0, 0]).tokens == [1]
    padded = pad_tree(tree, 8)  # padding leaves carry the root's token and are never followed
    assert padded.size == 8 and walk_greedy(padded, [5] + [0] * 7).tokens == [5]
    assert walk_greedy(chain_tree(5, [7, 9]), [7, 9, 4]).tokens == [7, 9, 4]


def random_tree(size: int, seed: int = 0) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    candidates = torch.randint(3, 500, (6, 4), generator=g)
    scores = torch.randn(6, 4, generator=g).log_softmax(-1).sort(-1, descending=True).values
    return build_tree(int(candidates[0, 0]), candidates, scores, size)


def assert_cache_holds(model, cache, seq):
    """The cache after `seq` equals a fresh run's: attention K/V and Gated DeltaNet states."""
    fresh = model.new_cache(64)
    model(torch.tensor([seq]), fresh)
    assert cache.length == len(seq)
    for layer in cache.k:
        torch.testing.assert_close(cache.k[layer][:, :, : len(seq)], fresh.k[layer][:, :, : len(seq)], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.v[layer][:, :, : len(seq)], fresh.v[layer][:, :, : len(seq)], atol=1e-5, rtol=0)
    for layer in cache.gdn:
        torch.testing.assert_close(cache.gdn[layer].conv, fresh.gdn[layer].conv, atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.gdn[layer].recurrent, fresh.gdn[layer].recurrent, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("fixed_shape", [False, True])
def test_tree_verify_equals_a_forward_over_each_path(targets, family, fixed_shape):
    """Node i's logits and taps equal those of a plain causal forward over prompt + its path;
    after keeping one path the cache holds what a fresh run over prompt + path holds."""
    model = targets[family]
    prompt = prompt_ids(10)
    tree = random_tree(12)
    taps = (1, 3)
    cache = model.new_cache(64, static=fixed_shape)
    model(torch.tensor([prompt]), cache)
    ids, depths, ancestors = tree_inputs(tree)
    if fixed_shape:  # the code CUDA graphs replay, run eagerly
        steps = StaticTargetSteps(model, cache, sizes=(1,), tap_layers=taps, use_graphs=False, tree_size=tree.size)
        cache.reset()
        model(torch.tensor([prompt]), cache)
        out = steps.verify_tree(ids, cache, depths, ancestors, taps)
    else:
        out = model.verify_tree(ids, cache, depths, ancestors, taps)
    assert cache.length == len(prompt) + tree.size
    deepest = max(range(tree.size), key=lambda i: tree.depths[i])
    assert tree.depths[deepest] >= 3  # the check below covers a real branch
    with torch.no_grad():
        for node in range(tree.size):
            seq = prompt + [tree.tokens[i] for i in tree.path_to(node)]
            ref = model(torch.tensor([seq]), tap_layers=taps)
            torch.testing.assert_close(out.logits[0, node], ref.logits[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out.taps[0, node], ref.taps[0, -1], atol=1e-4, rtol=1e-4)
    path = tree.path_to(deepest)
    cache.keep_tree_path(path)
    assert_cache_holds(model, cache, prompt + [tree.tokens[i] for i in path])


class RunnerUpDrafter(OracleDrafter):
    """Ranks the target's own greedy continuation SECOND at every slot, behind a wrong token:
    a chain accepts nothing, a tree that reaches the runners-up accepts whole blocks."""

    @torch.no_grad()
    def draft(self, cache, first_token, start_pos, embed, head, return_logits=False, num_drafts=None, block_len=None):
        right = OracleDrafter.draft(self, cache, first_token, start_pos, embed, head, num_drafts=num_drafts)[0]
        vocab = self.target.config.vocab_size
        logits = torch.zeros(1, right.numel(), vocab)
        for slot, token in enumerate(right.tolist()):
            logits[0, slot, (token + 1) % vocab] = 9.0  # best: wrong
            logits[0, slot, token] = 8.0  # runner-up: right
        wrong = logits.argmax(-1)
        return (wrong, logits) if return_logits else wrong


@pytest.fixture(scope="module")
def references(targets):
    return {family: Engine(model, max_len=128).generate(prompt_ids(), greedy(NEW)).tokens for family, model in targets.items()}


@pytest.fixture(scope="module")
def reference(references):
    return references["llama"]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("graphs", [False, True])
def test_tree_output_equals_target_greedy(targets, tiny_checkpoints, references, family, graphs):
    model = targets[family]
    drafter = make_drafter(tiny_checkpoints[family])
    engine = Engine(model, drafter=drafter, max_len=128, tree_size=16, cuda_graphs=graphs)
    checked = []

    def cache_matches_a_fresh_run(state):
        assert state["draft_cache"].length == len(state["committed"])
        assert_cache_holds(model, state["cache"], state["committed"])
        checked.append(state["accepted"])

    engine.on_step = cache_matches_a_fresh_run
    result = engine.generate(prompt_ids(), greedy(NEW))
    assert result.tokens == references[family] and len(checked) >= 3


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_tree_accepts_the_runners_up_a_chain_misses(targets, references, family):
    model = targets[family]
    chain = Engine(model, drafter=RunnerUpDrafter(model, prompt_ids()), max_len=128).generate(prompt_ids(), greedy(NEW))
    engine = Engine(model, drafter=RunnerUpDrafter(model, prompt_ids()), max_len=128, tree_size=24, tree_width=2)
    engine.on_step = lambda state: assert_cache_holds(model, state["cache"], state["committed"])
    tree = engine.generate(prompt_ids(), greedy(NEW))
    assert chain.tokens == tree.tokens == references[family]
    assert chain.stats.tau == 1.0
    # log-probs: best -0.36, runner-up -1.36 per slot. The all-runner-up path of 2 slots
    # (-2.72) is among the best 23 paths; that of 3 slots (-4.08) is not (more than 23 paths
    # score higher). So every step accepts exactly 2 drafts + the bonus, through nodes that
    # are not each other's neighbours in the tree's order.
    assert tree.stats.tau == 3.0 and tree.stats.accept_per_position[:3] == [1.0, 1.0, 0.0]


def test_sampled_tokens_follow_the_target_distribution_with_a_tree(llama):
    prompt = prompt_ids(8)
    engine = Engine(llama, drafter=RunnerUpDrafter(llama, prompt, block_size=3), max_len=64, tree_size=5, tree_width=3)
    assert_first_two_tokens_follow_the_target(llama, engine, prompt)


def test_tree_needs_a_drafter_and_two_tokens(llama, tiny_checkpoints):
    with pytest.raises(QfdError, match="needs a drafter"):
        Engine(llama, max_len=64, tree_size=8)
    with pytest.raises(QfdError, match="at least 2"):
        Engine(llama, drafter=make_drafter(tiny_checkpoints["llama"]), max_len=64, tree_size=1)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_compiled_tree_engine_is_token_identical_and_compiles_once(targets, tiny_checkpoints, family):
    """torch.compile'd steps (aot_eager: dynamo's capture and guards without codegen): the tree
    step compiles once at construction - slots, depths and the ancestor mask are buffers, not
    Python values - and gives the same tokens."""
    from tests.test_compile import counting

    torch._dynamo.reset()
    backend = counting()
    model = targets[family]
    drafter = make_drafter(tiny_checkpoints[family])
    engine = Engine(model, drafter=drafter, max_len=128, tree_size=12, compile_steps=True, compile_backend=backend)
    assert backend.frame_count == 3  # decode, tree verify, draft step
    for seed in range(2):
        ids = prompt_ids(12, seed)
        assert engine.generate(ids, greedy(NEW)).tokens == Engine(model, max_len=128).generate(ids, greedy(NEW)).tokens
    assert backend.frame_count == 3
    torch._dynamo.reset()


# --- the CLI: --tree on generate, serve and eval --------------------------------------------------
from tests.test_draft_vocab import _cli, _one_error_line, chat_drafters, engine_command, served_engine  # noqa: E402,F401 (helpers, fixture)


@pytest.mark.parametrize("command", ["generate", "serve", "eval"])
def test_cli_bad_tree_is_one_error_line(chat_drafters, capsys, command):
    target, plain, _ = map(str, chat_drafters)
    _one_error_line(*_cli([*engine_command(command, target), "--drafter", plain, "--tree", "1"], capsys)[::2], "--tree must be 0")
    _one_error_line(*_cli([*engine_command(command, target), "--tree", "8"], capsys)[::2], "--tree needs a drafter")


def test_cli_generate_and_serve_with_a_tree(chat_drafters, capsys):
    from qfd.stages.serve import ServeConfig, run

    target, plain, _ = map(str, chat_drafters)
    argv = ["generate", "--target", target, "--prompt", "Hello", "--max-new-tokens", "12", "--device", "cpu"]
    code, target_only, err = _cli(argv, capsys)
    assert code == 0, err
    code, out, err = _cli([*argv, "--drafter", plain, "--tree", "6"], capsys)
    assert code == 0, err
    assert out == target_only  # greedy: the target's text whatever the tree holds
    with served_engine(target=target, drafter=plain, tree=6) as engine:
        assert engine.tree_size == 6 and engine.verify_len == 6
    with pytest.raises(Exception, match="--engine qfd"):
        run(ServeConfig(target=target, drafter=plain, engine="vllm", tree=6))
