"""Hybrid drafting (method "hybrid"): each step, per request, the guesses of every drafter
that is worth its cost, merged into one tree.

Two drafters serve it. Suffix decoding (suffix.py) drafts from the request's own text and
from earlier requests' outputs in microseconds, and is often right for long stretches when
it finds a match. Learned heads (recurrent Medusa heads, recurrent_drafter.py) cost a few
small forwards a step but guess open text, where suffix decoding finds nothing.

Each step the suffix draft is made first. Its node chances (empirical probabilities),
times a calibration measured from what the target accepted, give its expected accepted
tokens. Suffix guesses are calibrated per band of match length: a guess that continues a
long match (text being copied) is right far more often than one after a two-token match
of the same frequency. The heads run only for the requests where their own measured
acceptance beats that by enough to pay for their time and for the extra verify rows,
judged by expected committed tokens per second with the target's forward cost
(adaptive.py's CostModel, when the config is adaptive). The drafts are then merged
(specdec.tree.merge_drafts) by calibrated chance, and nodes worth less than the verify row
they cost are cut.

Every guess is deterministic (verified one-hot), so the merged tree is verified exactly as
either drafter's tree would be: lossless for greedy and sampled requests alike.

What the target accepted is read back from the request's tokens at its next step (the
Drafter contract's reconciliation), so the drafter needs no hook in the engine.
"""
from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field, replace

from specdec.adaptive import CostModel, LineFit
from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.recurrent_drafter import RecurrentDrafter
from specdec.drafters.suffix import SuffixDraft, SuffixDrafter
from specdec.tree import DraftTree, ScoredDraft, merge_drafts

SUFFIX, HEADS = 0, 1
DISCOUNT = 0.98  # per verify: the calibrations follow about the last 50
REQUEST_DISCOUNT = 0.8
HEADS_MARGIN = 0.05  # running the heads must promise 5% more tokens per second
# The heads' trees stay small: each depth costs a heads step and an LM-head product per
# expanded node, and their guesses beyond a few tokens are rarely right (their 6-node trees
# were the fastest of their settings on open chat); suffix decoding drafts the long runs.
HEADS_MAX_DEPTH = 5
HEADS_MAX_NODES = 6
# Suffix match-length bands, each (its least match length, its calibration at start). Over
# evals/prompts' categories the target took 20% of the guesses that followed a 2-token
# match, 33% after 3, ~60% after 4-7 and ~70% after 8 or more, while their frequencies
# said ~0.5, 0.6, 0.9 and 1.0: one calibration for all let short matches in open text cut
# the long ones of an edit loop, or long ones let short ones through. A band starts at
# the factor measured there, weighing as much as BAND_PRIOR_GUESSES judged guesses.
MATCH_BANDS = ((2, 0.4), (3, 0.55), (4, 0.7), (8, 0.7))
BAND_PRIOR_GUESSES = 2.0
_BAND_STARTS = tuple(start for start, _ in MATCH_BANDS[1:])


def match_band(match_length: int) -> int:
    """The calibration band of a suffix draft's match length."""
    return bisect_right(_BAND_STARTS, match_length)


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


def _band_priors() -> list[_Calibration]:
    return [_Calibration(BAND_PRIOR_GUESSES * factor, BAND_PRIOR_GUESSES) for _, factor in MATCH_BANDS]


@dataclass
class _Offer:
    """What a request was offered at its last step, to score once its tokens are known."""

    root_position: int  # index of the root in the request's token ids
    paths: list[list[tuple[tuple[int, ...], float]]]  # per source: (path of tokens, its chance) of each guess
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
    heads: RecurrentDrafter | None
    cost: CostModel | None  # the target's forward cost; None: no time model (heads whenever they are worth more)
    suffix_calibrations: list[_Calibration] = field(default_factory=_band_priors)  # per match band
    heads_calibration: _Calibration = field(default_factory=_Calibration)
    heads_total: _HeadsWorth = field(default_factory=lambda: _HeadsWorth(1.0, 1.0))
    heads_worth: dict[str, _HeadsWorth] = field(default_factory=dict)
    heads_seconds: LineFit = field(default_factory=LineFit)  # heads drafting time against requests drafted
    offers: dict[str, _Offer] = field(default_factory=dict)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        for request in requests:
            self._score_offer(request)
        found = [self.suffix.draft(r) for r in requests]
        suffix = [(d.scored, self._suffix_factor(d)) for d in found]
        chosen = self._choose_heads(requests, suffix)
        heads = self._run_heads([requests[i] for i in chosen])
        min_chance = self._min_chance(requests, suffix)
        trees = []
        for i, request in enumerate(requests):
            drafts = [suffix[i]] + ([(heads[chosen.index(i)], self.heads_calibration.factor)] if i in chosen else [])
            merged = merge_drafts(request.token_ids[-1], drafts, request.num_draft_tokens, min_chance)
            self._remember(request, merged.tree, [d for d, _ in drafts], match_band(found[i].match_length))
            trees.append(merged.tree)
        return trees

    def free(self, request_id: str) -> None:
        self.suffix.free(request_id)
        self.offers.pop(request_id, None)
        self.heads_worth.pop(request_id, None)

    def forget_cached(self) -> None:
        self.suffix.forget_cached()

    # ---- choosing ---------------------------------------------------------------------

    def _suffix_factor(self, draft: SuffixDraft) -> float:
        return self.suffix_calibrations[match_band(draft.match_length)].factor

    def _choose_heads(self, requests: list[DraftRequest], suffix: list[tuple[ScoredDraft, float]]) -> list[int]:
        """Indices of the requests whose heads draft is worth running this step (suffix:
        each request's suffix draft and its calibration factor)."""
        if self.heads is None:
            return []
        gains = {i: self._heads_worth(r.request_id).mean - _expected(*suffix[i])
                 for i, r in enumerate(requests) if r.hidden is not None}
        order = sorted((i for i, gain in gains.items() if gain > 0), key=lambda i: -gains[i])
        if self.cost is None or not order:
            return order
        commits = len(requests) + sum(_expected(*d) for d in suffix)
        rows = len(requests) + sum(d.tree.num_drafts for d, _ in suffix)
        best, best_rate = 0, (1 + HEADS_MARGIN) * commits / self.cost.forward_time(rows)
        for m, i in enumerate(order, start=1):
            commits += gains[i]
            rows += max(min(requests[i].num_draft_tokens, HEADS_MAX_NODES) - suffix[i][0].tree.num_drafts, 0)
            rate = commits / (self.cost.forward_time(rows) + self._heads_time(m))
            if rate > best_rate:
                best, best_rate = m, rate
        return order[:best]

    def _heads_time(self, num_requests: int) -> float:
        if self.heads_seconds.w == 0:
            return 0.0
        intercept, slope = self.heads_seconds.line(LineFit())
        return max(intercept + slope * num_requests, 0.0)

    def _min_chance(self, requests: list[DraftRequest], suffix: list[tuple[ScoredDraft, float]]) -> float:
        """The least chance a node must have to be worth its verify row: a row costs the
        forward's slope in seconds, and the step earns commits / seconds."""
        if self.cost is None:
            return 0.0
        commits = len(requests) + sum(_expected(*d) for d in suffix)
        rows = len(requests) + sum(d.tree.num_drafts for d, _ in suffix)
        return self.cost.slope() * commits / self.cost.forward_time(rows)

    def _run_heads(self, requests: list[DraftRequest]) -> list[ScoredDraft]:
        if not requests or self.heads is None:
            return []
        start = time.perf_counter()
        drafts = self.heads.scored_trees([replace(r, num_draft_tokens=min(r.num_draft_tokens, HEADS_MAX_NODES),
                                                  max_depth=min(r.max_depth, HEADS_MAX_DEPTH)) for r in requests])
        self.heads_seconds.add(len(requests), time.perf_counter() - start)
        return drafts

    def _heads_worth(self, request_id: str) -> _HeadsWorth:
        worth = self.heads_worth.get(request_id)
        if worth is None:
            mean = self.heads_total.mean
            worth = self.heads_worth[request_id] = _HeadsWorth(2 * mean, 2.0)
        return worth

    # ---- learning -----------------------------------------------------------------------

    def _remember(self, request: DraftRequest, tree: DraftTree, drafts: list[ScoredDraft], band: int) -> None:
        """Keep, per source (drafts: the suffix draft, then the heads' if they ran), the
        paths of its guesses to score: the heads' that made it into the verified tree (what
        running them added), and every suffix guess, verified or cut. A cut suffix guess is
        judged by the tokens the target commits all the same, so that a bad start cannot
        cut all later suffix guesses for good (nothing verified, nothing learnt)."""
        kept = {tuple(tree.token_ids[n] for n in tree.path_to(i)[1:]) for i in range(1, tree.num_nodes)}
        paths: list[list[tuple[tuple[int, ...], float]]] = [[], []]
        for source, draft in enumerate(drafts):
            for i in range(1, draft.tree.num_nodes):
                path = tuple(draft.tree.token_ids[n] for n in draft.tree.path_to(i)[1:])
                if source == SUFFIX or path in kept:
                    paths[source].append((path, draft.probs[i]))
        self.offers[request.request_id] = _Offer(len(request.token_ids) - 1, paths, band)

    def _score_offer(self, request: DraftRequest) -> None:
        """Learn from the request's last offer, now that the tokens after its root are known."""
        offer = self.offers.pop(request.request_id, None)
        if offer is None or len(request.token_ids) <= offer.root_position + 1:
            return
        committed = tuple(request.token_ids[offer.root_position + 1:])
        for source, offered in enumerate(offer.paths):
            # A cut guess deeper than the tokens known so far is not judged unless it already
            # differs from them (a verified one always is: its verify commits past it).
            paths = [(path, chance) for path, chance in offered
                     if len(path) <= len(committed) or path[: len(committed)] != committed]
            if not paths:
                continue
            accepted = sum(1 for path, _ in paths if committed[: len(path)] == path)
            calibration = self.suffix_calibrations[offer.band] if source == SUFFIX else self.heads_calibration
            calibration.add(accepted, sum(chance for _, chance in paths))
            if source == HEADS:
                self._heads_worth(request.request_id).add(accepted, REQUEST_DISCOUNT)
                self.heads_total.add(accepted, DISCOUNT)


def _expected(draft: ScoredDraft, factor: float) -> float:
    """Accepted tokens the draft promises, calibrated by factor."""
    return factor * sum(draft.probs[1:])
