"""Tree verification: verify several draft continuations in one target forward.

A DFlash drafter predicts every slot of its block in one forward, each slot a distribution
over the vocabulary given the same context. A chain verifies only each slot's argmax; a tree
also verifies runners-up: node (d, r) proposes the r-th most likely token of slot d, and a
path from the root is one candidate continuation. The target runs all N nodes at once, each
node attending to the committed context and to its own ancestors (a tree attention mask,
SpecInfer / Medusa / EAGLE-2), and the longest path the target agrees with is kept.

The tree is built per step from the drafter's own scores (EAGLE-2's dynamic tree): the N - 1
paths of the highest summed log-probability among the top `width` tokens of each slot, found
best-first. Scores only fall along a path, so the chosen set is closed under prefixes. Nodes
are then laid out depth-first, so the drafter's best path is the first nodes in order.

Output is unchanged. Greedy: a child is followed only when its token equals the target's
argmax at its parent, so the committed tokens are the target's own greedy choices.
Sampling: at a node the children (distinct tokens, deterministic proposals) are tried in turn,
each kept with probability p(child) under the target's distribution with the tried ones
removed; when all are rejected the token is drawn from what is left (SpecInfer's multi-draft
rejection sampling for one-hot proposals), so every committed token follows p exactly.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from qfd.speculative import sample


@dataclass(frozen=True)
class DraftTree:
    """N nodes in an order where every parent comes before its children; node 0 is the root
    (the last committed token, not a draft). parents[0] = -1; depths[0] = 0; node i > 0
    proposes tokens[i], candidate ranks[i] of draft slot depths[i] - 1."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.parents)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
        # Built in a byte buffer, a row at a time from the parent's row (parents come first):
        # per step on the host, so no per-element tensor ops.
        n = self.size
        rows = bytearray(n * n)
        for i in range(n):
            parent = self.parents[i]
            if parent >= 0:
                rows[i * n : (i + 1) * n] = rows[parent * n : (parent + 1) * n]
            rows[i * n + i] = 1
        return torch.frombuffer(rows, dtype=torch.uint8).view(n, n).bool().to(device)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to `node`, both included."""
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]


def chain_tree(root_token: int, drafts: list[int]) -> DraftTree:
    """The chain a plain speculative step verifies, as a tree (tests, comparisons)."""
    n = len(drafts)
    return DraftTree(tuple(range(-1, n)), tuple(range(n + 1)), (0,) * (n + 1), (int(root_token), *map(int, drafts)))


def build_tree(root_token: int, candidates: torch.Tensor, scores: torch.Tensor, size: int) -> DraftTree:
    """The `size`-node tree (root included) of the best-scoring paths.

    candidates [k, W]: the drafter's top-W token ids per draft slot, best first; scores [k, W]:
    their log-probabilities. A path (r_1, ..., r_d) proposes candidates[j, r_{j+1}] at slot j and
    scores the sum of their log-probabilities. Best-first: popping a path pushes its first child
    (next slot, rank 0) and its next sibling (same slot, next rank); both score no more than it,
    so paths leave the heap best first and parents before children."""
    cand = candidates.tolist()
    logp = scores.float().tolist()
    depth_max, width = len(cand), len(cand[0]) if cand else 0
    parents, depths, ranks, tokens = [-1], [0], [0], [int(root_token)]
    if size > 1 and depth_max and width:
        # heap entries: (-score, order, parent node, slot, rank)
        heap = [(-logp[0][0], 0, 0, 0, 0)]
        order = 1
        while heap and len(parents) < size:
            neg, _, parent, slot, rank = heapq.heappop(heap)
            node = len(parents)
            parents.append(parent)
            depths.append(slot + 1)
            ranks.append(rank)
            tokens.append(int(cand[slot][rank]))
            if slot + 1 < depth_max:
                heapq.heappush(heap, (neg - logp[slot + 1][0], order, node, slot + 1, 0))
                order += 1
            if rank + 1 < width:
                sibling = neg + logp[slot][rank] - logp[slot][rank + 1]
                heapq.heappush(heap, (sibling, order, parent, slot, rank + 1))
                order += 1
    return depth_first(DraftTree(tuple(parents), tuple(depths), tuple(ranks), tuple(tokens)))


def depth_first(tree: DraftTree) -> DraftTree:
    """The same tree with its nodes in depth-first order, each node's children best first.
    Then every first child directly follows its parent: the best path is nodes 0, 1, 2, ...
    (kept without moving any K/V), and a Gated DeltaNet kernel carries the state from one
    node to the next except at a branch switch."""
    kids: list[list[int]] = [[] for _ in tree.parents]  # children in the order they were added: best first
    for node, parent in enumerate(tree.parents):
        if parent >= 0:
            kids[parent].append(node)
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(kids[node]))
    new_index = {old: new for new, old in enumerate(order)}
    return DraftTree(
        tuple(-1 if tree.parents[i] < 0 else new_index[tree.parents[i]] for i in order),
        tuple(tree.depths[i] for i in order),
        tuple(tree.ranks[i] for i in order),
        tuple(tree.tokens[i] for i in order),
    )


def pad_tree(tree: DraftTree, size: int) -> DraftTree:
    """Fill a smaller tree up to `size` nodes (fixed shapes for graphs) with unreachable
    leaves: copies of the root's token hanging off the root at rank -1, which no walk follows
    (walks compare children's tokens, and these are tried only after every real child)."""
    extra = size - tree.size
    if extra <= 0:
        return tree
    return DraftTree(tree.parents + (0,) * extra, tree.depths + (1,) * extra, tree.ranks + (-1,) * extra, tree.tokens + (tree.tokens[0],) * extra)


@dataclass(frozen=True)
class TreeVerdict:
    """path: the tree nodes kept, root first (accepted drafts = len(path) - 1); tokens: the
    committed ids = the accepted drafts' tokens + the bonus / resampled token."""

    path: list[int]
    tokens: list[int]

    @property
    def accepted(self) -> int:
        return len(self.path) - 1


def _real_children(tree: DraftTree, node: int) -> list[int]:
    return [c for c in tree.children(node) if tree.ranks[c] >= 0]


def walk_greedy(tree: DraftTree, choice: list[int]) -> TreeVerdict:
    """choice[i]: the target's argmax after node i's path. Follow the child whose token is the
    target's choice while there is one; the bonus is the choice at the last node kept."""
    path = [0]
    while True:
        nxt = [c for c in _real_children(tree, path[-1]) if tree.tokens[c] == choice[path[-1]]]
        if not nxt:
            break
        path.append(nxt[0])
    return TreeVerdict(path, [tree.tokens[i] for i in path[1:]] + [int(choice[path[-1]])])


def walk_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None) -> TreeVerdict:
    """probs [N, V]: the target's distribution after each node's path (`target_probs`).

    At a node, its children's tokens are tried in tree order: child c is kept with probability
    p(c) / (mass of p left), where p has the tokens already rejected at this node removed; a
    kept child becomes the next node. When none is kept, the token is drawn from p with the
    rejected tokens removed. That is exact: every committed token is distributed as p."""
    path = [0]
    while True:
        p = probs[path[-1]].float().clone()
        total = float(p.sum())  # the mass left: p's, less the tokens rejected at this node
        kept = None
        for child in _real_children(tree, path[-1]):
            token = tree.tokens[child]
            mass = float(p[token])
            u = float(torch.rand((), generator=generator, device=p.device))
            if total > 0 and u * total < mass:
                kept = child
                break
            p[token] = 0.0
            total -= mass
        if kept is None:
            total = p.sum()
            final = int(sample(p / total if total > 0 else probs[path[-1]].float(), generator))
            return TreeVerdict(path, [tree.tokens[i] for i in path[1:]] + [final])
        path.append(kept)


def tree_inputs(tree: DraftTree, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the target's tree verify needs (TargetModel.verify_tree): token ids [1, N], node
    depths [N] (RoPE position = committed length + depth) and the ancestor mask [N, N]."""
    # one host-to-device copy for all three (each copy from pageable memory waits for itself)
    n = tree.size
    packed = torch.cat([torch.tensor(tree.tokens + tree.depths, dtype=torch.long), tree.ancestor_mask().view(-1).long()]).to(device)
    return packed[:n].view(1, n), packed[n : 2 * n], packed[2 * n :].view(n, n).bool()
