"""Draft trees: the one representation of a request's candidate continuations.

Node 0 is the ROOT: the last committed token, whose KV is not computed yet, so the
target scores it together with the drafts. Every other node is a draft token whose
parent is the node before it on its path. Nodes are in topological order (parent index
< node index) and, by convention, in PRIORITY order too: the constructors below put the
most promising nodes first, so any prefix of the node list is itself a good, ancestor-
closed tree, which is what `prune` keeps.

Every draft is a DraftTree: a chain of k drafts is the tree root -> d1 -> ... -> dk,
and a request with no draft is the root alone. Static trees come from Medusa-style
`choices` (drafters/tree_choices.py); dynamic trees (EAGLE-2) from scored candidate
expansions.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

Candidate = tuple[int, int, float]  # (parent candidate id, token, cumulative draft log-prob); id 0 = root


@dataclass(eq=False)
class DraftTree:
    """A request's draft tree; see the module docstring for the conventions."""

    token_ids: list[int]  # [N] node tokens; token_ids[0] is the root (last committed token)
    parents: list[int]  # [N] parent node index; parents[0] == -1, else 0 <= parents[i] < i
    # [N, V] row i = the distribution node i's token was SAMPLED from (siblings drawn
    # i.i.d. share one row's values); row 0 (root) is unused. None: every node is a
    # deterministic guess given the context (top-k picks, n-gram), verified as one-hot.
    # Top-k picks must use None: they are not draws from the draft distribution, and
    # verifying them against it would bias the output.
    draft_probs: Tensor | None = None
    # [N] the drafter's estimate that the target accepts the path to each node (the root's
    # is 1; never higher than its parent's), for the policy to verify the nodes worth their
    # rows; None: the drafter does not score its nodes.
    chances: list[float] | None = None
    depths: list[int] = field(init=False)  # [N] root = 0
    _children: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0 or len(self.parents) != n or self.parents[0] != -1:
            raise ValueError(f"need parents[0] == -1 and one parent per token, got {self.parents} "
                             f"for {n} tokens")
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise ValueError(f"draft_probs shape {tuple(self.draft_probs.shape)}, expected ({n}, V)")
        if self.chances is not None and len(self.chances) != n:
            raise ValueError(f"{len(self.chances)} chances for {n} nodes")
        depths: list[int] = [0] * n
        children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"parents must satisfy 0 <= parents[i] < i (topological order): {self.parents}")
            depths[i] = depths[p] + 1
            children[p].append(i)
        self.depths, self._children = depths, children

    # ---- views -------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Query tokens a verify step runs: the root plus every draft node."""
        return len(self.token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self.token_ids) - 1

    @property
    def is_chain(self) -> bool:
        """One child per node: the nodes see each other causally, like plain tokens."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def max_depth(self) -> int:
        """The most drafts one step can accept (the longest root-to-leaf path)."""
        return max(self.depths)

    def children(self, i: int) -> list[int]:
        return list(self._children[i])

    def leaves(self) -> list[int]:
        return [i for i, kids in enumerate(self._children) if not kids]

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root to node i, both included."""
        path = [i]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def greedy_walk(self, picks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Greedy verification of this tree (picks [N]: the target's argmax on each node's
        row): from the root, move to the first child carrying its node's pick; where none
        does, emit the pick (recovered, or bonus at a leaf). Returns the accepted nodes
        (root excluded) and the emitted tokens (theirs, then the last pick)."""
        node, accepted = 0, list[int]()
        while True:
            child = next((c for c in self._children[node] if self.token_ids[c] == picks[node]), None)
            if child is None:
                return accepted, [self.token_ids[n] for n in accepted] + [picks[node]]
            accepted.append(child)
            node = child

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path of node indices, leaves in node order."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def positions(self, prefix_len: int) -> list[int]:
        """RoPE position of each node: the root sits at prefix_len, a node at root + depth."""
        return [prefix_len + d for d in self.depths]

    def attention_mask(self) -> Tensor:
        """[N, N] bool: node i attends to itself and its ancestors (the prefix is implied)."""
        n = self.num_nodes
        mask = torch.zeros(n, n, dtype=torch.bool)  # [N, N]
        for i in range(n):
            # Topological order: the parent's row (its ancestors) is already final.
            if i > 0:
                mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def chain(cls, token_ids: Sequence[int], draft_probs: Tensor | None = None) -> DraftTree:
        """token_ids = [root, d1, ..., dk]; draft_probs [k, V] for the drafts (a Draft.probs)."""
        n = len(token_ids)
        return cls(list(token_ids), list(range(-1, n - 1)), _with_root_row(draft_probs, n))

    @classmethod
    def from_expansion(
        cls,
        root: int,
        candidates: Sequence[Candidate],  # candidate k has id k + 1; its parent id is < k + 1
        max_drafts: int,
        # [len(candidates), V] only if candidates were sampled i.i.d. from these rows; None
        # for top-k picks (EAGLE-2's default), which are verified exactly as one-hot guesses.
        draft_probs: Tensor | None = None,
    ) -> DraftTree:
        """An EAGLE-2 dynamic tree: the max_drafts candidates of highest cumulative draft
        log-prob whose ancestors are all kept, in best-first order.

        With true cumulative log-probs a child never beats its parent, so this is the plain
        top-max_drafts. A child scoring above its parent (a heuristic score) cannot be kept
        without it: best-first expansion picks the child right after its parent.
        """
        return cls._expansion(root, candidates, max_drafts, draft_probs)[0]

    @classmethod
    def _expansion(cls, root: int, candidates: Sequence[Candidate], max_drafts: int,
                   draft_probs: Tensor | None) -> tuple[DraftTree, list[int]]:
        """`from_expansion`'s tree and the candidate index of each of its draft nodes."""
        parents = [c[0] for c in candidates]
        if any(not 0 <= p <= k for k, p in enumerate(parents)):
            raise ValueError("every candidate's parent id must be 0 (root) or an earlier candidate's id")
        kept = best_first(parents, [c[2] for c in candidates], max_drafts)  # candidate indices
        new_id = {0: 0} | {k + 1: i + 1 for i, k in enumerate(kept)}
        probs = None if draft_probs is None else draft_probs[torch.tensor(kept, dtype=torch.long)]
        tree = cls([root] + [candidates[k][1] for k in kept], [-1] + [new_id[parents[k]] for k in kept],
                   _with_root_row(probs, len(kept) + 1))
        return tree, kept

    # ---- pruning ------------------------------------------------------------------

    def prune(self, max_drafts: int, max_depth: int | None = None) -> DraftTree:
        """The first max_drafts draft nodes (in priority order) no deeper than max_depth.

        Ancestor-closed: a kept node's ancestors are shallower and come earlier.
        """
        keep = [i for i in range(self.num_nodes) if max_depth is None or self.depths[i] <= max_depth]
        return self.subtree(keep[: max_drafts + 1])

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """The tree of the given nodes, which must include the root and every kept node's parent."""
        keep = sorted(keep)
        new_index = {old: new for new, old in enumerate(keep)}
        if not keep or keep[0] != 0 or any(self.parents[i] not in new_index for i in keep[1:]):
            raise ValueError("a subtree needs the root and the parent of every kept node")
        if len(keep) == self.num_nodes:
            return self
        probs = None if self.draft_probs is None else self.draft_probs[torch.tensor(keep, dtype=torch.long)]
        chances = None if self.chances is None else [self.chances[i] for i in keep]
        return DraftTree([self.token_ids[i] for i in keep],
                         [-1] + [new_index[self.parents[i]] for i in keep[1:]], probs, chances)

    def likelier_than(self, min_chance: float) -> DraftTree:
        """The nodes whose chance is at least min_chance (ancestor-closed, as a node's chance
        is never above its parent's); the whole tree when its nodes are not scored."""
        if self.chances is None:
            return self
        return self.subtree([i for i, chance in enumerate(self.chances) if i == 0 or chance >= min_chance])


@dataclass(frozen=True)
class ScoredDraft:
    """A draft tree of deterministic guesses (verified one-hot) with each node's estimated
    chance that the target accepts the path to it, the drafter's confidence. Drafters that
    score their nodes return these, so that one tree can be cut or merged by worth."""

    tree: DraftTree
    probs: list[float]  # [N] path probability of each node; the root's is 1

    @classmethod
    def root_only(cls, root: int) -> ScoredDraft:
        return cls(DraftTree.chain([root]), [1.0])

    @classmethod
    def from_expansion(cls, root: int, candidates: Sequence[Candidate], max_drafts: int) -> ScoredDraft:
        """`DraftTree.from_expansion` of top-k picks, with exp(cumulative log-prob) as each node's chance."""
        tree, kept = DraftTree._expansion(root, candidates, max_drafts, None)
        return cls(tree, [1.0] + [math.exp(candidates[k][2]) for k in kept])


def merge_drafts(root: int, drafts: Sequence[tuple[ScoredDraft, float]], max_drafts: int,
                 min_prob: float = 0.0) -> ScoredDraft:
    """One tree of the union of several drafters' guesses: the max_drafts nodes of best
    weighted chance (ancestor-closed, best first), each at least min_prob.

    `drafts` pairs each draft with a weight that calibrates its chances (how its predicted
    acceptance compares with what the target accepted). A path two drafts share is one node
    whose chance is the higher of theirs. Every draft must be rooted at `root` and made of
    one-hot guesses (no draft_probs), so the union verifies exactly as each would alone.
    """
    tokens, parents, chances = [root], [-1], [1.0]
    children: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for draft, weight in drafts:
        tree = draft.tree
        if tree.token_ids[0] != root or tree.draft_probs is not None:
            raise ValueError("merged drafts must share the root and hold one-hot guesses only")
        merged = [0] * tree.num_nodes  # the draft's node -> its merged node
        for i in range(1, tree.num_nodes):
            key = (merged[tree.parents[i]], tree.token_ids[i])
            chance = weight * draft.probs[i]
            if key not in children:
                children[key] = len(tokens)
                tokens.append(tree.token_ids[i])
                parents.append(key[0])
                chances.append(chance)
            merged[i] = children[key]
            chances[merged[i]] = max(chances[merged[i]], chance)
    kept = best_first(parents[1:], chances[1:], max_drafts)  # merged node n is candidate n - 1
    kept = kept[: next((i for i, k in enumerate(kept) if chances[k + 1] < min_prob), len(kept))]
    new_index = {0: 0} | {k + 1: i + 1 for i, k in enumerate(kept)}
    kept_chances = [1.0] + [chances[k + 1] for k in kept]
    tree = DraftTree([root] + [tokens[k + 1] for k in kept], [-1] + [new_index[parents[k + 1]] for k in kept],
                     chances=kept_chances)
    return ScoredDraft(tree, kept_chances)


def expand_layer(
    frontier: Sequence[int],  # P candidate ids being expanded (0 = root)
    frontier_scores: Sequence[float],  # [P] their cumulative draft log-probs (root: 0)
    top_tokens: Tensor,  # [P, k] int64 each node's top-k next tokens from the draft
    top_logprobs: Tensor,  # [P, k] float their draft log-probs
) -> list[Candidate]:
    """One EAGLE-2 expansion step: the (parent, token, cumulative log-prob) candidates of
    the next layer, to append to the candidate list for `DraftTree.from_expansion`."""
    scores = torch.tensor(frontier_scores, dtype=torch.float64).unsqueeze(1) + top_logprobs.double()  # [P, k]
    return [(parent, tok, score)
            for parent, toks, row in zip(frontier, top_tokens.tolist(), scores.tolist())
            for tok, score in zip(toks, row)]


def best_first(parents: Sequence[int], scores: Sequence[float], budget: int) -> list[int]:
    """Up to `budget` candidate indices by best-first expansion from the root.

    parents[k] is candidate k's parent id (0 = root, j + 1 = candidate j). The result is
    ancestor-closed and in selection order (topological). Ties go to the earlier candidate.
    """
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]  # by parent id
    for k, p in enumerate(parents):
        children[p].append(k)
    heap = [(-scores[k], k) for k in children[0]]
    heapq.heapify(heap)
    kept: list[int] = []
    while heap and len(kept) < budget:
        _, k = heapq.heappop(heap)
        kept.append(k)
        for child in children[k + 1]:
            heapq.heappush(heap, (-scores[child], child))
    return kept


def _with_root_row(draft_probs: Tensor | None, num_nodes: int) -> Tensor | None:
    """[num_nodes - 1, V] draft rows -> [num_nodes, V] with a zero row for the root."""
    if draft_probs is None:
        return None
    if draft_probs.shape[0] != num_nodes - 1:
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows for {num_nodes - 1} drafts")
    return torch.cat([draft_probs.new_zeros(1, draft_probs.shape[1]), draft_probs])
