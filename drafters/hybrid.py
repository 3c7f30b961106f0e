"""Hybrid drafting (method "hybrid"): each step, per request, the guesses of every drafter
that is worth its cost, merged into one tree.

Two drafters serve it. Suffix decoding (suffix.py) drafts from the request's own text and
from earlier requests' outputs in microseconds, and is often right for long stretches when
it finds a match. Learned heads (recurrent Medusa heads, recurrent_drafter.py, or an EAGLE-3
head, eagle3.py) cost a few small forwards a step but guess open text, where suffix
decoding finds nothing.

Each step the suffix draft is made first. A node's chance is its parent's times its
share of the parent's continuations (empirical frequencies) times a calibration measured
from what the target accepted, per band of match length and per depth, given the parent
was taken: a guess that continues a long match (text being copied) is right far more
often than one after a two-token match of the same frequency, and a copy that has begun
goes on. Running the heads is offered to the policy (`option`) for the requests where
their own measured acceptance beats the suffix draft's, with the verify rows they would
add and their measured time; the policy chooses (`extend` then runs them) and merges
nothing itself. The drafts are merged (specdec.spec.tree.merge_drafts) by calibrated
chance into one tree per request, every node scored (`DraftTree.chances`), and the policy
verifies the likeliest nodes of the whole batch, as many as earn the most committed
tokens per second.

Every guess is deterministic (verified one-hot), so the merged tree is verified exactly as
either drafter's tree would be: lossless for greedy and sampled requests alike.

What the target accepted is read back from the request's tokens at its next step (the
Drafter contract's reconciliation); the heads get the target's hidden states or features
through the engine's hooks, which the hybrid passes on.
"""
from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field, replace

import torch

from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.drafters.recurrent_drafter import RecurrentDrafter
from specdec.drafters.suffix import SuffixDraft, SuffixDrafter
from specdec.spec.adaptive import LineFit
from specdec.spec.policy import DraftOption
from specdec.spec.tree import DraftTree, ScoredDraft, merge_drafts

HEADS = 1  # the heads' guesses in an offer's paths (the suffix's are first)
DISCOUNT = 0.98  # per verify: the calibrations follow about the last 50
REQUEST_DISCOUNT = 0.8
# The heads' trees stay small: each depth costs a heads step and an LM-head product per
# expanded node, and their guesses beyond a few tokens are rarely right (their 6-node trees
# were the fastest of their settings on open chat); suffix decoding drafts the long runs.
HEADS_MAX_DEPTH = 5
HEADS_MAX_NODES = 6
# An EAGLE-3 head's guesses hold on deeper (trained on its own outputs, its chances are
# path probabilities): it may offer larger trees, which the policy cuts by chance. Not yet
# measured against the recurrent heads' sizes.
EAGLE3_MAX_DEPTH = 6
EAGLE3_MAX_NODES = 12
# Suffix guesses are calibrated per cell: the band of the match length they continue
# (2, 3, 4-7, 8-15 or 16+ tokens) and their depth (1, 2, 3+), each given that its parent
# was accepted. Over evals/prompts' categories, each guess judged once the committed tokens
# decided it (drafts 4x the match length deep, so that short matches had deep guesses to
# judge), the target took this share of what the suffix frequencies promised (depth 1 / 2
# / 3+): 45 / 58 / ~72% after a 2-token match, 57 / 70 / ~75% after 3, 71 / 75 / ~88%
# after 4-7, 86 / 91 / ~94% after 8-15 and 97% at every depth after 16+: a copy that has
# begun goes on. One calibration for all let short matches in open text cut an edit
# loop's long ones. A cell starts at the factor measured there (CELL_PRIORS[band][depth]),
# weighing as much as PRIOR_GUESSES guesses.
MATCH_BAND_STARTS = (3, 4, 8, 16)  # least match length of each band after the first (2 tokens)
CELL_PRIORS = ((0.45, 0.58, 0.72), (0.57, 0.7, 0.75), (0.71, 0.75, 0.88), (0.86, 0.91, 0.94), (0.97, 0.97, 0.97))
PRIOR_GUESSES = 2.0


def match_band(match_length: int) -> int:
    """The calibration band of a suffix draft's match length."""
    return bisect_right(MATCH_BAND_STARTS, match_length)


def depth_cell(depth: int) -> int:
    """The calibration cell of a guess's depth (1, 2, 3+)."""
    return min(depth, len(CELL_PRIORS[0])) - 1


@dataclass
class _Calibration:
    """Discounted accepted nodes against predicted chance: how far a source's chances are
    to be trusted (starts at 1, trusted as given)."""

    accepted: float = 1.0
    predicted: float = 1.0

    @property
    def factor(self) -> float:
        return min(self.accepted / max(self.predicted, 1e-9), 1.0)

    def add(self, accepted: float, predicted: float, discount: float = DISCOUNT) -> None:
        self.accepted = discount * self.accepted + accepted
        self.predicted = discount * self.predicted + predicted


def _cell_priors() -> list[list[_Calibration]]:
    return [[_Calibration(PRIOR_GUESSES * factor, PRIOR_GUESSES) for factor in band] for band in CELL_PRIORS]


@dataclass(frozen=True)
class _Guess:
    path: tuple[int, ...]  # its tokens after the root
    chance: float  # a suffix guess's given its parent's path is accepted; a heads guess's for its path


@dataclass
class _Offer:
    """What a request was offered at one step, kept until its tokens decide every guess."""

    root_position: int  # index of the root in the request's token ids
    paths: list[list[_Guess]]  # per source
    band: int  # the suffix draft's match band


@dataclass
class _HeadsWorth:
    """A request's accepted heads guesses per step that ran them (seeded from all requests')."""

    accepted: float
    steps: float

    @property
    def mean(self) -> float:
        return self.accepted / max(self.steps, 1e-9)

    def add(self, accepted: int, discount: float) -> None:
        self.accepted = discount * self.accepted + accepted
        self.steps = discount * self.steps + 1


@dataclass
class HybridDrafter(Drafter):
    suffix: SuffixDrafter
    heads: RecurrentDrafter | Eagle3Drafter | None
    suffix_calibrations: list[list[_Calibration]] = field(default_factory=_cell_priors)  # [band][depth cell]
    heads_calibration: _Calibration = field(default_factory=_Calibration)
    heads_total: _HeadsWorth = field(default_factory=lambda: _HeadsWorth(1.0, 1.0))
    heads_worth: dict[str, _HeadsWorth] = field(default_factory=dict)
    heads_seconds: LineFit = field(default_factory=LineFit)  # heads drafting time against requests drafted
    offers: dict[str, list[_Offer]] = field(default_factory=dict)  # per request, those with guesses undecided
    heads_runs: int = 0

    scores_nodes = True

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """Each request's suffix draft, its nodes scored by calibrated chance."""
        trees = []
        for request in requests:
            if request.request_id in self.offers:
                self._score_offers(request)
            lookup = self.suffix.lookup(request)
            if not lookup.match_length:  # no match: the common step of open text, kept cheap
                trees.append(DraftTree([request.token_ids[-1]], [-1], chances=[1.0]))
                continue
            found = self.suffix.build(request, lookup)
            merged = merge_drafts(request.token_ids[-1], [(self._calibrated(found), 1.0)], request.num_draft_tokens)
            self._remember_suffix(request, found)
            trees.append(merged.tree)
        return trees

    def option(self, requests: list[DraftRequest], trees: list[DraftTree]) -> DraftOption | None:
        """Running the heads for the requests whose heads are worth more than their suffix
        draft (trees: those drafts), with the rows they would add and their time."""
        if self.heads is None:
            return None
        gains = {i: self._heads_worth(r.request_id).mean - _expected(trees[i])
                 for i, r in enumerate(requests) if self.heads.ready(r)}
        rows = {i: max(min(requests[i].num_draft_tokens, self._heads_limits[1]) - trees[i].num_drafts, 0)
                for i in gains}
        return DraftOption(gains, rows, self._heads_time)

    def extend(self, requests: list[DraftRequest], trees: list[DraftTree], chosen: list[int]) -> list[DraftTree]:
        """The trees with the chosen requests' heads drafts merged in by calibrated chance."""
        heads = self._run_heads([requests[i] for i in chosen])
        factor = self.heads_calibration.factor
        trees = list(trees)
        for i, draft in zip(chosen, heads, strict=True):
            request, suffix = requests[i], trees[i]
            assert suffix.chances is not None  # propose scores every node
            merged = merge_drafts(request.token_ids[-1], [(ScoredDraft(suffix, suffix.chances), 1.0),
                                                          (draft, factor)], request.num_draft_tokens)
            self._remember_heads(request, merged.tree, draft)
            trees[i] = merged.tree
        return trees

    @property
    def reads_hidden(self) -> bool:  # type: ignore[override]
        return self.heads is not None and self.heads.reads_hidden

    @property
    def feature_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.heads.feature_layers if self.heads is not None else ()

    def observe_hidden(self, request_id: str, hidden: torch.Tensor) -> None:  # hidden [H]
        if self.heads is not None:
            self.heads.observe_hidden(request_id, hidden)

    def observe_features(self, request_id: str, start: int, features: torch.Tensor) -> None:  # features [n, F]
        if self.heads is not None:
            self.heads.observe_features(request_id, start, features)

    def free(self, request_id: str) -> None:
        if self.heads is not None:
            self.heads.free(request_id)
        self.suffix.free(request_id)
        self.offers.pop(request_id, None)
        self.heads_worth.pop(request_id, None)

    def forget_cached(self) -> None:
        self.suffix.forget_cached()

    # ---- choosing ---------------------------------------------------------------------

    def _calibrated(self, draft: SuffixDraft) -> ScoredDraft:
        """The suffix draft with each node's chance as its parent's times its conditional
        frequency (its count over its parent's) times its cell's calibration: a copy that
        holds on is likely to hold on further, so a deep guess keeps most of its parent's
        chance when the target keeps taking such guesses."""
        cells = self.suffix_calibrations[match_band(draft.match_length)]
        tree, probs = draft.scored.tree, draft.scored.probs
        chances = [1.0]
        for i in range(1, tree.num_nodes):  # parents come before their children
            parent = tree.parents[i]
            factor = cells[depth_cell(tree.depths[i])].factor
            chances.append(chances[parent] * min(_conditional(probs, parent, i) * factor, 1.0))
        return ScoredDraft(tree, chances)

    @property
    def _heads_limits(self) -> tuple[int, int]:
        """(depth, nodes) the heads draft at most."""
        if isinstance(self.heads, Eagle3Drafter):
            return EAGLE3_MAX_DEPTH, EAGLE3_MAX_NODES
        return HEADS_MAX_DEPTH, HEADS_MAX_NODES

    def _heads_time(self, num_requests: int) -> float:
        if self.heads_seconds.w == 0:
            return 0.0
        intercept, slope = self.heads_seconds.line(LineFit())
        return max(intercept + slope * num_requests, 0.0)

    def _run_heads(self, requests: list[DraftRequest]) -> list[ScoredDraft]:
        if not requests or self.heads is None:
            return []
        start = time.perf_counter()
        depth, nodes = self._heads_limits
        drafts = self.heads.scored_trees([replace(r, num_draft_tokens=min(r.num_draft_tokens, nodes),
                                                  max_depth=min(r.max_depth, depth)) for r in requests])
        if self.heads_runs:  # the first run sets up kernels and buffers (2x a later one on the CPU):
            self.heads_seconds.add(len(requests), time.perf_counter() - start)  # timed, it priced them out for good
        self.heads_runs += 1
        return drafts

    def _heads_worth(self, request_id: str) -> _HeadsWorth:
        worth = self.heads_worth.get(request_id)
        if worth is None:
            mean = self.heads_total.mean
            worth = self.heads_worth[request_id] = _HeadsWorth(2 * mean, 2.0)
        return worth

    # ---- learning -----------------------------------------------------------------------

    def _remember_suffix(self, request: DraftRequest, found: SuffixDraft) -> None:
        """Keep every suffix guess of this step to score once the committed tokens decide it,
        verified or cut: a cut guess is judged by the tokens the target commits all the
        same, so that a bad start cannot cut all later suffix guesses for good (nothing
        verified, nothing learnt)."""
        draft = found.scored
        guesses = [_Guess(_path(draft.tree, i), _conditional(draft.probs, draft.tree.parents[i], i))
                   for i in range(1, draft.tree.num_nodes)]
        offer = _Offer(len(request.token_ids) - 1, [guesses, []], match_band(found.match_length))
        self.offers.setdefault(request.request_id, []).append(offer)

    def _remember_heads(self, request: DraftRequest, tree: DraftTree, draft: ScoredDraft) -> None:
        """Keep this step's heads guesses that made it into the request's tree (what running
        them offered), beside its suffix guesses."""
        kept = {_path(tree, i) for i in range(1, tree.num_nodes)}
        guesses = [_Guess(path, draft.probs[i]) for i in range(1, draft.tree.num_nodes)
                   if (path := _path(draft.tree, i)) in kept]
        offers = self.offers.setdefault(request.request_id, [])
        root_position = len(request.token_ids) - 1
        if not offers or offers[-1].root_position != root_position:  # the suffix offered nothing this step
            offers.append(_Offer(root_position, [[], []], 0))
        offers[-1].paths[HEADS].extend(guesses)

    def _score_offers(self, request: DraftRequest) -> None:
        """Learn from the guesses the request's tokens now decide; keep the undecided ones.
        A cut guess deeper than the tokens committed since its step waits for more of
        them: judging it only when it already differs would count its failures and miss
        its successes (a verified guess is always decided: its verify commits past it)."""
        pending = []
        for offer in self.offers.pop(request.request_id, []):
            committed = tuple(request.token_ids[offer.root_position + 1:])
            (suffix, heads), undecided = _decide(offer.paths, committed)
            reached = [g for g in suffix if committed[: len(g.path) - 1] == g.path[:-1]]
            for cell, calibration in enumerate(self.suffix_calibrations[offer.band]):
                _learn(calibration, [g for g in reached if depth_cell(len(g.path)) == cell], committed)
            if heads:
                accepted = _learn(self.heads_calibration, heads, committed)
                self._heads_worth(request.request_id).add(accepted, REQUEST_DISCOUNT)
                self.heads_total.add(accepted, DISCOUNT)
            if any(undecided):
                pending.append(replace(offer, paths=undecided))
        if pending:
            self.offers[request.request_id] = pending


def _decide(paths: list[list[_Guess]], committed: tuple[int, ...]) -> tuple[list[list[_Guess]], list[list[_Guess]]]:
    """Per source, the guesses the committed tokens decide (inside them, or already
    differing from them) and the ones they do not yet."""
    decided: list[list[_Guess]] = [[] for _ in paths]
    undecided: list[list[_Guess]] = [[] for _ in paths]
    for source, guesses in enumerate(paths):
        for g in guesses:
            known = len(g.path) <= len(committed) or g.path[: len(committed)] != committed
            (decided if known else undecided)[source].append(g)
    return decided, undecided


def _learn(calibration: _Calibration, guesses: list[_Guess], committed: tuple[int, ...]) -> int:
    """Add the guesses' outcome to the calibration; the number accepted."""
    if not guesses:
        return 0
    accepted = sum(1 for g in guesses if committed[: len(g.path)] == g.path)
    calibration.add(accepted, sum(g.chance for g in guesses))
    return accepted


def _path(tree: DraftTree, node: int) -> tuple[int, ...]:
    """The tokens after the root on the path to a node."""
    return tuple(tree.token_ids[n] for n in tree.path_to(node)[1:])


def _conditional(probs: list[float], parent: int, node: int) -> float:
    """A suffix node's frequency among its parent's continuations (probs: path frequencies)."""
    return probs[node] / max(probs[parent], 1e-9)


def _expected(tree: DraftTree) -> float:
    """Accepted tokens the scored tree promises."""
    return sum(tree.chances[1:]) if tree.chances is not None else 0.0
