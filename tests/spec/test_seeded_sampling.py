"""A seeded request decodes the same tokens whatever was drafted (specdec.spec.verify).

The target is a synthetic second-order Markov model (logits = a table row chosen by the
last two tokens), so each verify step can be fed exact target rows for any draft tree.
Plain decoding is the verifier with root-only trees, as in the engine. Speculative
decoding draws random trees (root-only, chains, branching trees; guesses that agree with
plain decoding's future and guesses that do not) and shares each step with other
requests (unseeded, greedy, sampled drafts with probabilities). The seeded request with
one-hot drafts must commit exactly the plain tokens; with sampled drafts its output must
be deterministic given those drafts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest
import torch
from torch import Tensor

from specdec.model_runner import ForwardOutput
from specdec.request import Request
from specdec.sampling_params import SamplingParams
from specdec.scheduler import ScheduledRequest
from specdec.spec.tree import DraftTree
from specdec.spec.verify import verify

V = 16
TABLE = torch.randn(V * V, V, generator=torch.Generator().manual_seed(0)) * 1.5  # [V * V, V]
PROMPT = [3, 7, 1, 12]
NUM_TOKENS = 40
PARAMS = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
          SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, min_p=0.05)]


def next_logits(context: list[int]) -> Tensor:  # [V] the target's row after `context`
    return TABLE[context[-2] * V + context[-1]]


@dataclass
class Stream:
    """One request and how its drafts are made."""

    request: Request
    drafts: random.Random  # the drafter's randomness
    oracle: list[int] = field(default_factory=list)  # plain decoding's output, for right guesses
    with_probs: bool = False  # sampled drafts, verified with their probabilities


def new_request(name: str, params: SamplingParams) -> Request:
    request = Request(name, PROMPT, params, None, max_tokens=NUM_TOKENS, eos_token_ids=set())
    request.num_computed_tokens = request.num_tokens - 1  # prefilled up to the last known token
    return request


def random_tree(stream: Stream) -> DraftTree:
    rng, request = stream.drafts, stream.request
    shape = rng.choice(["root", "chain", "chain", "tree", "tree"])
    size = {"root": 1, "chain": rng.randint(2, 7), "tree": rng.randint(2, 10)}[shape]
    parents = [-1] + [i - 1 if shape == "chain" else rng.randint(0, i - 1) for i in range(1, size)]
    future = stream.oracle[request.num_output_tokens:]
    tokens = [request.all_token_ids[-1]]
    for i in range(1, size):
        depth = 1 + (0 if parents[i] == 0 else _depth(parents, parents[i]))
        right = depth <= len(future) and rng.random() < 0.7
        tokens.append(future[depth - 1] if right else rng.randrange(V))
    probs = None
    if stream.with_probs:
        probs = torch.softmax(torch.randn(size, V, generator=torch.Generator().manual_seed(rng.randrange(2**31))), -1)
    return DraftTree(tokens, parents, probs)


def _depth(parents: list[int], node: int) -> int:
    depth = 0
    while node > 0:
        node, depth = parents[node], depth + 1
    return depth


def tree_logits(request: Request, tree: DraftTree) -> Tensor:  # [N, V] one target row per node
    rows = []
    for node in range(tree.num_nodes):
        path = [tree.token_ids[n] for n in tree.path_to(node)[1:]]
        rows.append(next_logits(request.all_token_ids + path))
    return torch.stack(rows)


def step(streams: list[Stream], trees: list[DraftTree]) -> None:
    """One verify step over the batch; commits what each request accepted."""
    batch = [ScheduledRequest(s.request, num_new_tokens=1, num_draft_tokens=t.num_drafts, max_depth=t.max_depth)
             for s, t in zip(streams, trees)]
    logits = torch.cat([tree_logits(s.request, t) for s, t in zip(streams, trees)])  # [R, V]
    output = ForwardOutput(logits, torch.zeros(logits.shape[0], 4), [t.num_nodes for t in trees])
    for stream, result in zip(streams, verify(batch, trees, output)):
        for token in result.tokens:
            stream.request.append_token(token)
        stream.request.num_computed_tokens = stream.request.num_tokens - 1


def plain_decode(params: SamplingParams) -> list[int]:
    stream = Stream(new_request("plain", params), random.Random(0))
    while stream.request.num_output_tokens < NUM_TOKENS:
        step([stream], [DraftTree.chain([stream.request.all_token_ids[-1]])])
    return stream.request.output_token_ids[:NUM_TOKENS]


def speculative_decode(mine: Stream, companions: list[Stream], order: random.Random) -> list[int]:
    """Decode `mine` with random trees, in a batch with the companions (finished ones leave)."""
    while mine.request.num_output_tokens < NUM_TOKENS:
        streams = [mine] + [c for c in companions if c.request.num_output_tokens < NUM_TOKENS]
        order.shuffle(streams)  # the seeded request's row moves around the batch
        step(streams, [random_tree(s) for s in streams])
    return mine.request.output_token_ids[:NUM_TOKENS]


def companions(seed: int) -> list[Stream]:
    """Other requests sharing the steps: unseeded, greedy, another seed with sampled drafts."""
    rng = random.Random(seed)
    return [Stream(new_request("unseeded", SamplingParams(temperature=1.0)), random.Random(rng.random())),
            Stream(new_request("greedy", SamplingParams(temperature=0.0)), random.Random(rng.random())),
            Stream(new_request("sampled", SamplingParams(temperature=0.9, seed=99)), random.Random(rng.random()),
                   with_probs=True)]


@pytest.mark.parametrize("params", PARAMS, ids=["t0.8", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("seed", [0, 1, 2**40 + 5])
def test_one_hot_drafts_commit_exactly_the_plain_tokens(params: SamplingParams, seed: int) -> None:
    seeded = replace(params, seed=seed)
    torch.manual_seed(seed % 1000)
    expected = plain_decode(seeded)
    for run in range(3):  # other drafts, other companions, another global RNG state each time
        torch.manual_seed(run)
        mine = Stream(new_request("mine", seeded), random.Random(f"{seed}-{run}"), oracle=expected)
        assert speculative_decode(mine, companions(run), random.Random(run)) == expected


def test_greedy_trees_commit_exactly_the_plain_tokens() -> None:
    """verify()'s greedy route (one argmax, host walks) over chains, trees and lone roots,
    batched with sampled companions."""
    greedy = SamplingParams(temperature=0.0)
    expected = plain_decode(greedy)
    for run in range(3):
        torch.manual_seed(run)
        mine = Stream(new_request("mine", greedy), random.Random(f"greedy-{run}"), oracle=expected)
        assert speculative_decode(mine, companions(run), random.Random(run)) == expected


def test_guesses_are_accepted_and_rejected() -> None:
    """The trees above exercise both outcomes: some steps commit several tokens, some one."""
    seeded = SamplingParams(temperature=0.8, seed=5)
    expected = plain_decode(seeded)
    mine = Stream(new_request("mine", seeded), random.Random(1), oracle=expected)
    steps = 0
    while mine.request.num_output_tokens < NUM_TOKENS:
        step([mine], [random_tree(mine)])
        steps += 1
    assert mine.request.output_token_ids[:NUM_TOKENS] == expected
    assert 3 < steps < NUM_TOKENS - 3  # speculation paid off on some steps, not on all


def test_other_seeds_and_the_global_rng_decode_otherwise() -> None:
    """Controls: the identity above is not vacuous (another seed differs; unseeded varies)."""
    a = plain_decode(SamplingParams(temperature=0.8, seed=1))
    assert plain_decode(SamplingParams(temperature=0.8, seed=1)) == a
    assert plain_decode(SamplingParams(temperature=0.8, seed=2)) != a
    torch.manual_seed(0)
    first = plain_decode(SamplingParams(temperature=0.8))
    torch.manual_seed(1)
    assert plain_decode(SamplingParams(temperature=0.8)) != first


def test_sampled_drafts_are_deterministic_given_the_drafts() -> None:
    seeded = SamplingParams(temperature=0.9, seed=11)
    outs = []
    for run in range(3):
        torch.manual_seed(run)  # the global RNG and the companions change; the drafts do not
        mine = Stream(new_request("mine", seeded), random.Random("same drafts"), with_probs=True)
        outs.append(speculative_decode(mine, companions(run), random.Random(run)))
    assert outs[0] == outs[1] == outs[2]
