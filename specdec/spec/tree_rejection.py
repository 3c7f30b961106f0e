"""Tree verification: multi-candidate rejection sampling over draft trees.

For request i the target scored one row per tree node: row u is the target's
distribution for the token AFTER node u (the root row is plain decoding's row).

Greedy: from the root, move to the first child carrying the target's argmax; stop at a
node none of whose children does and emit that argmax (recovered, or bonus at a leaf).

Stochastic (SpecInfer's multi-round speculative sampling, children drawn independently):
at node u with residual r = target_probs(u), try the children c in order with their
draft distribution d_c: accept c with probability min(1, r[x_c] / d_c[x_c]); on a
rejection set r = norm(max(0, r - d_c)). An accepted child becomes the new u. If every
child is rejected, the recovered token is sampled from r; at a leaf the bonus token is
sampled from target_probs(leaf). Each round is one ordinary speculative step against r,
so the emitted token follows r; by induction the first emitted token follows the
target, and so does every later one. This needs each x_c ~ d_c independently given the
path (i.i.d. sampled siblings, duplicates allowed) or x_c deterministic (one-hot d_c:
top-k / n-gram guesses, where a rejection just zeroes r[x_c]). Siblings sampled
WITHOUT replacement are neither, and would need another residual update.

Seeded requests with deterministic drafts (draft_probs None) are verified by the
exponential race instead, which makes them reproducible: at a node deciding position t
the target's token is y = argmax(target_probs(u) / E_t), with E_t the V exponentials of
a generator keyed by (seed, t) (`specdec.sampler.sample_keyed`). The walk moves to the
first child carrying y, else emits y (recovered, or bonus at a leaf). Each emitted token
follows the target (E_t is fresh at every position), and it is exactly the token plain
decoding with the same seed picks at t, whatever the tree held.

Random draws: a seeded request's draws are keyed by the position they decide. The root
row decides position `positions[b]` (the request's number of known tokens) and a node at
depth d decides positions[b] + d. Race exponentials for position t come from the key
(seed, t, RACE_STREAM), as in plain decoding; with draft_probs, the acceptance uniforms
of the children of a depth-d node come from (seed, positions[b] + d, ACCEPT_STREAM), the
j-th sibling taking the j-th draw. Nothing depends on how many draws other positions,
steps or requests made, so a chain tree gives `specdec.spec.rejection.rejection_sample`'s
output exactly. Unseeded rows use the global RNG in batch-shaped calls, so their outputs
match the chain sampler in distribution only.

Shapes: B requests, G = sum(N_i) flat node rows, C = max children of a node, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch
from torch import Tensor

from specdec.sampler import (
    RACE_STREAM,
    SamplingTensors,
    argmax,
    keyed_generator,
    keyed_uniforms,
    logits_to_probs,
    sample_keyed,
    sample_probs,
)
from specdec.spec.rejection import check_positions, device_index, residual_probs
from specdec.spec.tree import DraftTree


@dataclass
class TreeResult:
    accepted_nodes: list[int]  # node indices of the accepted path, root excluded, by depth
    tokens: list[int]  # the accepted nodes' tokens, then one recovered or bonus token


@dataclass
class FlatTrees:
    """A batch of trees laid out on the flat target rows (one row per node)."""

    starts: list[int]  # [B] first flat row of each tree (its root)
    sizes: list[int]  # [B] nodes per tree
    tokens: Tensor  # [G] int64 node tokens
    parent: Tensor  # [G] int64 flat row of the parent; -1 at roots
    request: Tensor  # [G] int64 owning request
    children: Tensor  # [G, C] int64 flat rows of the children in node order; -1 padded
    max_depth: int

    @classmethod
    def build(cls, trees: list[DraftTree], device: torch.device) -> FlatTrees:
        # Flat lists then tensor ops: a Python loop per node would dominate big batches.
        # Built on the host, where the trees are, then copied over without waiting for the GPU.
        sizes = [t.num_nodes for t in trees]
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)
        starts = torch.cumsum(as_long([0] + sizes[:-1]), 0) if trees else as_long([])  # [B]
        request = torch.repeat_interleave(torch.arange(len(trees)), as_long(sizes))  # [G]
        tokens = as_long(list(chain.from_iterable(t.token_ids for t in trees)))  # [G]
        local_parent = as_long(list(chain.from_iterable(t.parents for t in trees)))  # [G]
        is_child = local_parent >= 0  # [G]
        parent = torch.where(is_child, local_parent + starts[request], -1)  # [G]
        slot = _rank_among_equal(parent)  # [G] rank among its siblings
        width = int(slot[is_child].max()) + 1 if bool(is_child.any()) else 1
        children = torch.full((len(tokens), width), -1, dtype=torch.int64)  # [G, C]
        children[parent[is_child], slot[is_child]] = torch.nonzero(is_child).squeeze(1)
        to_device = lambda t: t.to(device, non_blocking=True)
        return cls(starts=starts.tolist(), sizes=sizes, tokens=to_device(tokens), parent=to_device(parent),
                   request=to_device(request), children=to_device(children),
                   max_depth=max((t.max_depth for t in trees), default=0))


def _rank_among_equal(keys: Tensor) -> Tensor:
    """[G] -> [G] int64: how many earlier entries carry the same key."""
    order = torch.argsort(keys, stable=True)  # [G]; equal keys keep index order
    sorted_keys = keys[order]  # [G]
    pos = torch.arange(len(keys), device=keys.device)  # [G]
    new_group = torch.ones_like(sorted_keys, dtype=torch.bool)  # [G]
    new_group[1:] = sorted_keys[1:] != sorted_keys[:-1]
    group_start = torch.cummax(torch.where(new_group, pos, 0), 0).values  # [G]
    rank = torch.empty_like(pos)  # [G]
    rank[order] = pos - group_start
    return rank


def tree_verify(
    target_logits: Tensor,  # [G, V]: per request, one row per tree node, in node order
    trees: list[DraftTree],  # [B]
    st: SamplingTensors,  # one row per request
    positions: list[int] | None = None,  # [B] position each root row decides; needed by seeded rows
) -> list[TreeResult]:
    _check_shapes(target_logits, trees, st, positions)
    if not trees:
        return []
    greedy = st.greedy.tolist()
    sampled = [b for b, g in enumerate(greedy) if not g]
    # Greedy trees are walked on the host (DraftTree.greedy_walk) from one argmax of every row.
    picks = argmax(target_logits) if any(greedy) else target_logits.new_empty(0, dtype=torch.int64)  # [G] or [0]
    last_node = torch.empty(len(trees), dtype=torch.int64, device=target_logits.device)  # [B] flat row
    final_token = torch.empty_like(last_node)  # [B]
    flat = FlatTrees.build(trees, target_logits.device) if sampled else None
    if flat is not None:
        keyed = st.keyed_rows([t.draft_probs is None for t in trees])
        if keyed:
            assert positions is not None  # _check_shapes
            rows = device_index(keyed, target_logits.device)  # [K]
            last_node[rows], final_token[rows] = _keyed(target_logits, flat, st, keyed, [positions[b] for b in keyed])
        stochastic = sorted(set(sampled) - set(keyed))
        if stochastic:
            rows = device_index(stochastic, target_logits.device)  # [S]
            last_node[rows], final_token[rows] = _stochastic(target_logits, trees, flat, st, stochastic, positions)
    # The one wait for the GPU: every result comes back in one copy.
    values = torch.cat([picks, last_node, final_token]).tolist()
    picked, last_nodes, final_tokens = values[:len(picks)], values[len(picks):-len(trees)], values[-len(trees):]
    results, start = [], 0
    for b, tree in enumerate(trees):
        if greedy[b]:
            accepted, tokens = tree.greedy_walk(picked[start:start + tree.num_nodes])
            results.append(TreeResult(accepted_nodes=accepted, tokens=tokens))
        else:
            results.append(_result(tree, last_nodes[b] - start, final_tokens[b]))
        start += tree.num_nodes
    return results


def _keyed(
    target_logits: Tensor,  # [G, V]
    flat: FlatTrees,
    st: SamplingTensors,  # [B] rows
    requests: list[int],  # K seeded requests with one-hot drafts
    positions: list[int],  # [K] position each one's root row decides
) -> tuple[Tensor, Tensor]:  # last accepted flat row [K], final token [K]
    sub = st.select(requests)
    seeds = [s for s in sub.seeds if s is not None]
    target_probs = _target_probs(target_logits, flat, sub, requests)  # [G, V], K trees filled
    node = device_index([flat.starts[b] for b in requests], target_logits.device)  # [K] starting at the roots
    final = torch.empty_like(node)  # [K]
    walking = list(range(len(requests)))  # host-side: rows whose last pick matched a child
    depth = 0
    # Level by level, so that a row draws the V exponentials of a position only once the
    # walk reaches it: one race per emitted token, as in plain decoding.
    while walking:
        at = device_index(walking, node.device)  # [L]
        here = node[at]  # [L]
        choice = sample_keyed(target_probs[here], [seeds[k] for k in walking],
                              [positions[k] + depth for k in walking])  # [L]
        child = _child_carrying(flat, here, choice)  # [L] flat row, -1 if none
        moved = child >= 0  # [L]
        final[at] = choice
        node[at] = torch.where(moved, child, here)
        walking = [k for k, m in zip(walking, moved.tolist()) if m]
        depth += 1
    return node, final


def _child_carrying(
    flat: FlatTrees,
    node: Tensor,  # [L] flat rows
    token: Tensor,  # [L]
) -> Tensor:  # [L] flat row of the first child of node carrying token, -1 if none
    children = flat.children[node]  # [L, C]
    match = (children >= 0) & (flat.tokens[children.clamp(min=0)] == token.unsqueeze(1))  # [L, C]
    first = match.to(torch.int64).argmax(dim=1, keepdim=True)  # [L, 1]: argmax takes the first max
    return torch.where(match.any(dim=1), children.gather(1, first).squeeze(1), -1)


def _stochastic(
    target_logits: Tensor,  # [G, V]
    trees: list[DraftTree],  # [B]
    flat: FlatTrees,
    st: SamplingTensors,  # [B] rows
    requests: list[int],  # S stochastic request indices
    positions: list[int] | None,  # [B] position each root row decides; None if no row is seeded
) -> tuple[Tensor, Tensor]:  # last accepted flat row [S], final token [S]
    sub = st.select(requests)
    target_probs = _target_probs(target_logits, flat, sub, requests)  # [G, V], S trees filled
    draft_probs = _flat_draft_probs(trees, target_logits.shape[1], target_logits.device)  # [G, V] or None
    uniform = _node_uniforms(trees, flat, sub.seeds, requests, positions, target_logits.device)  # [G]
    node = device_index([flat.starts[b] for b in requests], target_logits.device)  # [S] starting at the roots
    residual = target_probs[node]  # [S, V]
    active = torch.ones_like(node, dtype=torch.bool)  # [S] still walking down
    # The two early exits below wait for the GPU, at most (C + 1) times per level: cheaper
    # than running every level and slot to the end, and only sampled requests walk here.
    for _ in range(flat.max_depth + 1):
        moved = torch.zeros_like(active)  # [S] a child of `node` was accepted this level
        for slot in range(flat.children.shape[1]):
            child = flat.children[node, slot]  # [S] flat row, -1 when there is none
            trying = active & ~moved & (child >= 0)  # [S]
            if not bool(trying.any()):
                break  # children are packed by slot: no row has a later one either
            child = child.clamp(min=0)
            accept, residual = _try_child(residual, child, trying, flat.tokens, draft_probs, uniform)
            node = torch.where(accept, child, node)
            moved |= accept
        # A moved row restarts from the target at its new node; a stopped row keeps its
        # residual (all children rejected) or the target itself (a leaf: bonus).
        residual = torch.where(moved.unsqueeze(1), target_probs[node], residual)
        active &= moved
        if not bool(active.any()):
            break
    return node, sample_probs(residual, _final_generators(trees, flat, node, sub.seeds, requests, positions))


def _final_generators(
    trees: list[DraftTree], flat: FlatTrees,
    node: Tensor,  # [S] flat row where each walk stopped
    seeds: list[int | None],  # [S]
    requests: list[int],  # [S]
    positions: list[int] | None,  # [B]
) -> list[torch.Generator | None]:  # [S] the race generator of the position each stop decides
    if all(s is None for s in seeds):
        return [None] * len(seeds)
    assert positions is not None  # _check_shapes
    stops = node.tolist()  # seeded rows only: which position they decide is known after the walk
    return [None if seed is None else
            keyed_generator(seed, positions[b] + trees[b].depths[stop - flat.starts[b]], RACE_STREAM)
            for seed, b, stop in zip(seeds, requests, stops)]


def _try_child(
    residual: Tensor,  # [S, V] current residual at each row's node
    child: Tensor,  # [S] flat row of the candidate child (clamped; see trying)
    trying: Tensor,  # [S] bool rows that test a child now
    tokens: Tensor,  # [G] node tokens
    draft_probs: Tensor | None,  # [G, V] or None: one-hot
    uniform: Tensor,  # [G] one uniform per node
) -> tuple[Tensor, Tensor]:  # accepted [S] bool, updated residual [S, V]
    # Rows not trying may point at a root, whose token id need not be a draft vocab index.
    token = torch.where(trying, tokens[child], 0).unsqueeze(1)  # [S, 1]
    if draft_probs is None:
        draft = torch.zeros_like(residual).scatter_(1, token, 1.0)  # [S, V] one-hot guesses
    else:
        draft = draft_probs[child]  # [S, V]
    draft_at = draft.gather(1, token).squeeze(1)  # [S]
    target_at = residual.gather(1, token).squeeze(1)  # [S]
    # u < r/d without a division; a zero draft prob means a bogus draft: reject.
    accept = trying & (draft_at > 0) & (uniform[child] * draft_at < target_at)  # [S]
    rejected = (trying & ~accept).unsqueeze(1)  # [S, 1]
    return accept, torch.where(rejected, residual_probs(residual, draft), residual)


def _target_probs(
    target_logits: Tensor,  # [G, V]
    flat: FlatTrees,
    sub: SamplingTensors,  # [S]
    requests: list[int],  # [S], ascending
) -> Tensor:  # [G, V]; only the S requests' rows are written
    # Request by request, from the host's layout (a boolean mask would make the GPU report its size first).
    index = [r for b in requests for r in range(flat.starts[b], flat.starts[b] + flat.sizes[b])]
    rows = torch.tensor(index, dtype=torch.int64).to(target_logits.device, non_blocking=True)  # [sum(counts)]
    out = torch.empty(target_logits.shape, dtype=torch.float32, device=target_logits.device)
    out[rows] = logits_to_probs(target_logits[rows], sub.repeat([flat.sizes[b] for b in requests]))
    return out


def _flat_draft_probs(trees: list[DraftTree], vocab: int, device: torch.device) -> Tensor | None:
    """[G, V] every node's draft row (one-hot for trees without probs), or None if no tree has any."""
    if all(t.draft_probs is None for t in trees):
        return None
    rows = [t.draft_probs.float().to(device) if t.draft_probs is not None else _one_hot_drafts(t, vocab, device)
            for t in trees]
    return torch.cat(rows)


def _one_hot_drafts(tree: DraftTree, vocab: int, device: torch.device) -> Tensor:
    """[N, V] one-hot rows at the draft tokens; the root row (any token id) stays zero."""
    rows = torch.zeros(tree.num_nodes, vocab, device=device)  # [N, V]
    drafts = torch.tensor(tree.token_ids[1:], dtype=torch.int64).to(device, non_blocking=True).unsqueeze(1)  # [N-1, 1]
    rows[1:].scatter_(1, drafts, 1.0)  # in place through the view
    return rows


def _node_uniforms(
    trees: list[DraftTree], flat: FlatTrees, seeds: list[int | None], requests: list[int],
    positions: list[int] | None, device: torch.device,
) -> Tensor:  # [G] uniform [0, 1), one per node (roots unused)
    uniform = torch.rand(flat.tokens.shape[0], device=device)  # unseeded rows, in one call
    for b, seed in zip(requests, seeds):
        tree = trees[b]
        if seed is not None and tree.num_drafts > 0:
            assert positions is not None  # _check_shapes
            start = flat.starts[b] + 1
            uniform[start : start + tree.num_drafts] = _keyed_node_uniforms(tree, seed, positions[b]).to(
                device, non_blocking=True)
    return uniform


def _keyed_node_uniforms(tree: DraftTree, seed: int, position: int) -> Tensor:
    """[N - 1] the draft nodes' uniforms: the children of a depth-d node decide position
    position + d, and the j-th of them takes that key's j-th draw."""
    slot = [0] * tree.num_nodes  # [N] rank among siblings
    taken = [0] * tree.num_nodes  # [N] children seen so far per node
    for i, p in enumerate(tree.parents[1:], start=1):
        slot[i], taken[p] = taken[p], taken[p] + 1
    width = max(taken)
    table = torch.stack([keyed_uniforms(seed, position + d, width) for d in range(tree.max_depth)])  # [D, W]
    parent_depth = torch.tensor(tree.depths[1:], dtype=torch.int64) - 1  # [N - 1]
    return table[parent_depth, torch.tensor(slot[1:], dtype=torch.int64)]


def _result(tree: DraftTree, last: int, final_token: int) -> TreeResult:
    path = tree.path_to(last)[1:]
    return TreeResult(accepted_nodes=path, tokens=[tree.token_ids[i] for i in path] + [final_token])


def _check_shapes(target_logits: Tensor, trees: list[DraftTree], st: SamplingTensors,
                  positions: list[int] | None) -> None:
    num_nodes = sum(t.num_nodes for t in trees)
    if target_logits.shape[0] != num_nodes:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, expected {num_nodes} "
                         f"(one per tree node)")
    for t in trees:
        if t.draft_probs is not None and t.draft_probs.shape[1] != target_logits.shape[1]:
            raise ValueError(f"draft_probs vocab {t.draft_probs.shape[1]} != target vocab "
                             f"{target_logits.shape[1]}")
    if len(st) != len(trees):
        raise ValueError(f"{len(st)} sampling rows for {len(trees)} requests")
    check_positions(positions, st)
