"""Adaptive speculation: each step, choose every request's draft length (or whether to
verify its tree) to maximise expected committed tokens per second.

Two models feed the choice:
- `CostModel`: seconds of a target forward over T query tokens, a line fitted to the
  measured step times (a start-up calibration, `calibrate`, is its prior), plus the
  drafter's time per draft depth (zero for n-gram lookup, a draft forward per depth for a
  draft model).
- `AcceptanceStats`: per request, the chance that its first draft token is accepted and
  the chance that each later one is, given the ones before it were (from discounted
  counts), seeded from all requests' counts.

With those rates f and r, draft token i of a request is worth f * r^(i-1) committed
tokens in expectation. `plan` adds draft
tokens across the batch in order of worth while expected tokens per second still rise,
and stops (k = 0 everywhere, plain decoding) when the next token costs more time than it
is worth. A branching draft (more nodes than depth) is one all-or-nothing increment
worth its request's mean accepted length.
A request left at k = 0 gets a one-token probe every `PROBE_EVERY` steps per request in
the batch (a probe costs a verify row, which is dearer when more requests share a step)
so that its acceptance estimate can recover.

A drafter that scores its nodes (hybrid drafting: `DraftTree.chances`, calibrated by
what the target accepted) is sized after drafting instead: every request may draft its
limit whenever a certain guess would pay for its row at this batch size, and `select`
verifies the batch's likeliest nodes, as many as earn the most committed tokens per
second on the cost line. A request-level gate on past acceptance would shut out the
steps the drafter knows are good (a long suffix match in an edit loop after a stretch of
open text), and its probes would verify guesses the drafter knows are bad. `choose`
weighs a costlier source the drafter offers (its heads) the same way, with its drafting
time.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from specdec.kernels.kv_cache import PagedKV
from specdec.model_runner import StepInputs
from specdec.spec.policy import DraftLimit, DraftOption, SpeculationPolicy, StepReport
from specdec.spec.step_timer import measure_seconds
from specdec.spec.tree import DraftTree

if TYPE_CHECKING:
    from specdec.executor import Executor

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)
PROBE_EVERY = 8
SAFETY_MARGIN = 0.1  # a draft plan must promise 10% more tokens per second than none
REQUEST_DISCOUNT = 0.8  # weight of a request's older verifies against its newest one
GLOBAL_DISCOUNT = 0.98
CORRECTION_RATE = 0.1  # how fast measured drafting times move the estimate
FIT_DISCOUNT = 0.97  # per step: the cost line follows about the last 30 steps
FIT_MAX_TOKENS = 128  # steps with more query tokens are not fitted
# The line is refitted every few observed steps, not every one: it follows about the last
# 30 steps anyway, and the refit (with the prior rescaled) costs as much as a step's other
# speculation bookkeeping.
LINE_REFRESH = 4
PRIOR_WEIGHT = 0.005  # the calibration points weigh at most 1/200 of a measured 1-token step together
# A scored node's chance counts 10% less when choosing how many to verify: the cost line
# holds only the forward, not a drafted step's verify and bookkeeping, and a wrong "yes"
# costs a row while a wrong "no" costs nothing (without it the unbiased calibration
# drafted twice as often for no more speed).
NODE_MARGIN = 0.1
OPTION_MARGIN = 0.05  # a draft option (running heads) must promise 5% more tokens per second
# Scored drafting looks up every step while its drafts are verified; after LOOKUP_PATIENCE
# steps in a row that verified nothing of a request (open text: its lookups cost a few
# percent of a step and find nothing worth a row), only every LOOKUP_EVERY-th step, so a
# copy that begins later is found a token later at most. (Patience 1, every 4th step:
# an idle step 1.02x plain instead of 1.04x, but 7% more steps on the input-grounded
# prompts, whose copies begin after short stretches of open text.)
LOOKUP_PATIENCE = 4
LOOKUP_EVERY = 2
# A draft option declined is weighed again only every OPTION_EVERY-th drafting step (while
# one is taken, every step): offering and weighing the heads cost as much as a lookup, and
# where they do not pay (the CPU at batch 1, mostly) they seldom start paying from one step
# to the next.
OPTION_EVERY = 8


class CostModel:
    """Predicted seconds for a target forward over T query tokens and for drafting to a depth.

    A forward's time is modelled as a line, intercept + slope * T, fitted by least squares
    in relative error to the step times measured in recent decode and verify steps (older
    ones discounted), plus the start-up calibration points as a light prior that keeps the
    fit defined before there is spread in T. Measured steps carry what the calibration cannot
    know: how many requests share the step and how long their contexts are.
    """

    def __init__(self, sizes: list[int], seconds: list[float]) -> None:
        self.sizes = sizes  # calibrated token counts and their forward times
        self.seconds = seconds
        self.calibration = LineFit()  # the calibration points, a light prior
        for size, time_s in zip(sizes, seconds):
            self.calibration.add(size, time_s, weight=PRIOR_WEIGHT / len(sizes) * self._relative(time_s),
                                 discount=1.0)
        self.calibration_line = self.calibration.line(LineFit())
        self.fit = LineFit()
        self._line: tuple[float, float] | None = None  # line(), refitted every LINE_REFRESH observed forwards
        self._unfitted = 0  # forwards observed since the line was fitted
        self.draft_seconds_per_depth = 0.0

    def forward_time(self, num_tokens: float) -> float:
        intercept, slope = self.line()
        return max(intercept + slope * num_tokens, 1e-6)

    def line(self) -> tuple[float, float]:
        """(intercept, slope) of the forward time in seconds against query tokens."""
        if self._line is None:
            self._line = self.fit.line(self._prior())
        return self._line

    def draft_time(self, depth: int) -> float:
        return self.draft_seconds_per_depth * depth

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        """A decode/verify step's time (steps over more than FIT_MAX_TOKENS are ignored)."""
        if num_tokens <= FIT_MAX_TOKENS:
            self.fit.add(num_tokens, seconds, weight=self._relative(seconds))
            self._unfitted += 1
            if self._unfitted >= LINE_REFRESH:
                self._line, self._unfitted = None, 0

    def observe_draft(self, depth: int, seconds: float) -> None:
        # Averaged from zero, so that one slow first call (an n-gram index being built, a
        # draft model's prompt prefill) cannot by itself switch speculation off.
        if depth > 0:
            self.draft_seconds_per_depth += CORRECTION_RATE * (seconds / depth - self.draft_seconds_per_depth)

    def _relative(self, seconds: float) -> float:
        """A point's weight in the fits: least squares in relative error (1 / t^2, the
        smallest calibrated forward weighing 1). The choices compare rates, and forwards of many
        tokens cost more per token than a verify's few (attention, caches): weighted
        equally, the calibration's 32- and 64-token points had set a line whose rows cost
        almost a whole decode, and no guess was ever worth one."""
        return (self.seconds[0] / max(seconds, 1e-9)) ** 2

    def _prior(self) -> LineFit:
        """The calibration points, rescaled to the level of the measured steps: the
        calibration gives the curve's shape, the measurements its height."""
        if self.fit.w == 0:
            return self.calibration
        intercept, slope = self.calibration_line
        mean_x, mean_y = self.fit.x / self.fit.w, self.fit.y / self.fit.w
        return self.calibration.scaled(mean_y / max(intercept + slope * mean_x, 1e-9))


@dataclass
class LineFit:
    """Discounted sums for a weighted least-squares line y = a + b x."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, weight: float = 1.0, discount: float = FIT_DISCOUNT) -> None:
        self.w = discount * self.w + weight
        self.x = discount * self.x + weight * x
        self.y = discount * self.y + weight * y
        self.xx = discount * self.xx + weight * x * x
        self.xy = discount * self.xy + weight * x * y

    def scaled(self, factor: float) -> LineFit:
        """The same points with every y multiplied by factor."""
        return replace(self, y=self.y * factor, xy=self.xy * factor)

    def line(self, prior: LineFit) -> tuple[float, float]:
        """(intercept, slope) over these points and the prior's; the slope is never negative."""
        w, x, y = self.w + prior.w, self.x + prior.x, self.y + prior.y
        xx, xy = self.xx + prior.xx, self.xy + prior.xy
        spread = w * xx - x * x
        slope = max((w * xy - x * y) / spread, 0.0) if spread > 1e-12 else 0.0
        return (y - slope * x) / w, slope


def _rate(hits: float, misses: float) -> float:
    return min(max(hits / max(hits + misses, 1e-9), 0.01), 0.99)


@dataclass
class _Counts:
    """Discounted outcomes of a request's (or all requests') verifies.

    Draft tokens are accepted in runs: once the first is right, the next ones often are
    too (an n-gram match or an easy continuation), so the first position and the later
    ones get separate rates; a draft token at depth d is then worth first * later^(d-1).
    """

    first_hits: float  # verifies that accepted their first draft token
    first_misses: float
    later_hits: float  # accepted draft tokens after the first
    later_misses: float  # verifies that stopped after accepting at least one but not all
    accepted_tokens: float = 0.0  # accepted draft tokens of all verifies
    verifies: float = 0.0
    nodes: float = 0.0  # draft nodes verified, of all verifies (a tree's size, not its depth)
    idle_steps: int = 0  # steps since its last draft (probing)

    @property
    def first(self) -> float:
        return _rate(self.first_hits, self.first_misses)

    @property
    def later(self) -> float:
        return _rate(self.later_hits, self.later_misses)

    def gain(self, depth: int) -> float:
        """Expected committed tokens added by the draft token at this depth (1-based)."""
        return self.first * self.later ** (depth - 1)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per verify: the worth of a whole (branching) draft."""
        return self.accepted_tokens / max(self.verifies, 1e-9)

    @property
    def mean_nodes(self) -> float:
        """Draft nodes per verify: what a whole draft costs in query tokens."""
        return self.nodes / max(self.verifies, 1e-9)

    def add(self, drafted: int, accepted: int, discount: float, nodes: int) -> None:
        self.first_hits = discount * self.first_hits + (accepted > 0)
        self.first_misses = discount * self.first_misses + (accepted == 0)
        if accepted > 0:
            self.later_hits = discount * self.later_hits + accepted - 1
            self.later_misses = discount * self.later_misses + (accepted < drafted)
        self.accepted_tokens = discount * self.accepted_tokens + accepted
        self.verifies = discount * self.verifies + 1
        self.nodes = discount * self.nodes + nodes

    def seeded(self, weight: float) -> _Counts:
        """Fresh counts worth `weight` verifies at these rates."""
        first, later, gain = self.first, self.later, self.mean_accepted
        return _Counts(weight * first, weight * (1 - first), weight * later, weight * (1 - later),
                       weight * gain, weight, weight * self.mean_nodes)


class AcceptanceStats:
    """Per-request acceptance estimates, seeded from the drafter's running totals."""

    def __init__(self) -> None:
        self.total = _Counts(1.0, 1.0, 1.0, 1.0, accepted_tokens=1.0, verifies=1.0, nodes=4.0)
        self.requests: dict[str, _Counts] = {}

    def get(self, request_id: str) -> _Counts:
        counts = self.requests.get(request_id)
        if counts is None:  # a new request starts from two pseudo-verifies of the global estimate
            counts = self.total.seeded(2.0)
            self.requests[request_id] = counts
        return counts

    def observe(self, request_id: str, drafted: int, accepted: int, nodes: int) -> None:
        counts = self.get(request_id)
        counts.add(drafted, accepted, REQUEST_DISCOUNT, nodes)
        counts.idle_steps = 0
        self.total.add(drafted, accepted, GLOBAL_DISCOUNT, nodes)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


@dataclass
class _Increment:
    index: int  # which limit it extends
    tokens: float  # query tokens it adds to the forward (expected, for a whole draft)
    gain: float  # committed tokens it adds, in expectation
    drafts: int  # the request's draft tokens once it is taken


@dataclass(frozen=True)
class _Cut:
    """The scored nodes a step verifies: those of at least min_chance, worth `commits`
    tokens (NODE_MARGIN off each node), over `rows` query tokens."""

    min_chance: float
    commits: float
    rows: int


class AdaptiveSpeculation(SpeculationPolicy):
    def __init__(self, cost: CostModel, whole_drafts: bool, scored: bool = False) -> None:
        self.cost = cost  # the target's forward cost, learnt from the steps it sees
        # The drafter branches (trees): a draft is worth its measured mean accepted
        # length only whole, so it is granted all or nothing.
        self.whole_drafts = whole_drafts
        # The drafter scores its nodes: they are cut after drafting (`select`).
        self.scored = scored
        self.stats = AcceptanceStats()
        self._option_wait = 0  # drafting steps until a declined option is weighed again

    def grant(self, limits: list[DraftLimit], base_tokens: int, base_commits: int) -> list[int]:
        """Each request's draft tokens at the best expected tokens per second (maybe 0)."""
        if not limits:
            return []
        if self.scored:  # sized by `select`; none at all where not even a sure guess pays
            if not self._sure_guess_pays(len(limits)):
                return [0] * len(limits)
            return [limit.num_draft_tokens if self._looks_up(limit.request.request_id) else 0 for limit in limits]
        chosen = self._choose(self._increments(limits), base_tokens, float(base_commits))
        probe_every = PROBE_EVERY * len(limits)
        return [self._probe_or(limit, chosen.get(i, 0), probe_every) for i, limit in enumerate(limits)]

    def _increments(self, limits: list[DraftLimit]) -> list[_Increment]:
        increments = []
        for i, limit in enumerate(limits):
            counts = self.stats.get(limit.request.request_id)
            if self.whole_drafts:  # a drafter may offer fewer nodes than granted: its mean size is the cost
                size = min(max(counts.mean_nodes, 1.0), limit.num_draft_tokens)
                increments.append(_Increment(i, size, counts.mean_accepted, limit.num_draft_tokens))
            else:
                increments += [_Increment(i, 1, counts.gain(d), d) for d in range(1, limit.max_depth + 1)]
        # Within one request gains fall with depth, so this order takes each one's depths in turn.
        return sorted(increments, key=lambda inc: (-inc.gain / inc.tokens, inc.drafts))

    def _choose(self, increments: list[_Increment], tokens: float, gain: float) -> dict[int, int]:
        """Draft tokens per limit index at the best expected tokens per second along the order."""
        drafts: dict[int, int] = {}
        # Speculate only for a clear predicted gain: the models are estimates, and a wrong
        # "yes" costs more (verify rows, per-request attention calls) than a wrong "no".
        best, best_rate = dict(drafts), (1 + SAFETY_MARGIN) * gain / self._step_time(tokens, 0)
        for inc in increments:
            tokens += inc.tokens
            gain += inc.gain
            drafts[inc.index] = inc.drafts
            rate = gain / self._step_time(tokens, max(drafts.values()))
            if rate > best_rate:
                best, best_rate = dict(drafts), rate
        return best

    def _step_time(self, tokens: float, max_drafts: int) -> float:
        return self.cost.forward_time(tokens) + self.cost.draft_time(max_drafts)

    def _probe_or(self, limit: DraftLimit, drafts: int, probe_every: int) -> int:
        """`drafts`, or when a request has gone without drafting for `probe_every` steps,
        a one-token probe (the whole tree for branching drafts) so its estimate can recover."""
        counts = self.stats.get(limit.request.request_id)
        if drafts > 0:
            return drafts
        counts.idle_steps += 1
        if counts.idle_steps < probe_every:
            return 0
        counts.idle_steps = 0
        return limit.num_draft_tokens if self.whole_drafts else 1

    def select(self, trees: list[DraftTree]) -> list[DraftTree]:
        """The batch's scored nodes worth their rows (unscored trees stay whole)."""
        chances = _chances(trees) if self.scored else []
        if not chances:  # nothing scored was drafted: the common step, kept cheap
            return trees
        cut = self._cut(_fixed_rows(trees), chances)
        return [tree.likelier_than(cut.min_chance) for tree in trees]

    def weighs_options(self) -> bool:
        if self._option_wait > 0:
            self._option_wait -= 1
            return False
        return True

    def choose(self, trees: list[DraftTree], option: DraftOption) -> list[int]:
        """The requests whose option (their heads' draft) earns the most tokens per second,
        its drafting time and extra rows included, over verifying the trees as they are."""
        chosen = self._choose_option(trees, option)
        self._option_wait = 0 if chosen else OPTION_EVERY - 1
        return chosen

    def _choose_option(self, trees: list[DraftTree], option: DraftOption) -> list[int]:
        order = sorted((i for i, gain in option.gains.items() if gain > 0), key=lambda i: -option.gains[i])
        if not order:
            return []
        cut = self._cut(_fixed_rows(trees), _chances(trees))
        commits, rows = cut.commits, cut.rows
        best, best_rate = 0, (1 + OPTION_MARGIN) * commits / self.cost.forward_time(rows)
        for m, i in enumerate(order, start=1):
            commits += option.gains[i]
            rows += option.rows.get(i, 0)
            rate = commits / (self.cost.forward_time(rows) + option.seconds(m))
            if rate > best_rate:
                best, best_rate = m, rate
        return order[:best]

    def _looks_up(self, request_id: str) -> bool:
        """Whether a scored drafter drafts for the request this step (see LOOKUP_PATIENCE);
        a verified draft resets the count (`observe_verify`)."""
        counts = self.stats.get(request_id)
        counts.idle_steps += 1
        return counts.idle_steps <= LOOKUP_PATIENCE or counts.idle_steps % LOOKUP_EVERY == 0

    def _sure_guess_pays(self, num_requests: int) -> bool:
        """Whether a guess the target surely takes is worth its verify row in a step of
        num_requests: (n + 1 / (1 + NODE_MARGIN)) / t(n + 1) > n / t(n) on the cost line."""
        intercept, slope = self.cost.line()
        n = num_requests
        now, more = max(intercept + slope * n, 1e-9), max(intercept + slope * (n + 1), 1e-9)
        return (n + 1 / (1 + NODE_MARGIN)) * now > n * more

    def _cut(self, base_rows: int, chances: list[float]) -> _Cut:
        """Which scored nodes to verify (chances: every one's): the k likeliest, with the k
        that earns the most committed tokens per second on the cost line (0: none). The
        best rate is the bar, not the rate of every node: a long copy whose guesses are
        all likely would otherwise set a bar that none of them clears."""
        chances = sorted(chances, reverse=True)
        intercept, slope = self.cost.line()
        commits = best_commits = float(base_rows)
        best_k, best_rate = 0, commits / max(intercept + slope * base_rows, 1e-9)
        for k, chance in enumerate(chances, start=1):
            commits += chance / (1 + NODE_MARGIN)
            rate = commits / max(intercept + slope * (base_rows + k), 1e-9)
            if rate > best_rate:
                best_k, best_rate, best_commits = k, rate, commits
        return _Cut(chances[best_k - 1] if best_k else math.inf, best_commits, base_rows + best_k)

    def observe_step(self, report: StepReport) -> None:
        # Only decode and verify steps: a prefill token costs differently from a draft row,
        # and the line is what one more draft row costs.
        if report.decode_only:
            self.cost.observe_forward(report.num_query_tokens, report.forward_seconds)
        self.cost.observe_draft(report.max_draft_depth, report.draft_seconds)

    def observe_verify(self, request_id: str, num_drafted: int, num_accepted: int, num_nodes: int) -> None:
        self.stats.observe(request_id, num_drafted, num_accepted, num_nodes)

    def forget(self, request_id: str) -> None:
        self.stats.forget(request_id)


def _fixed_rows(trees: list[DraftTree]) -> int:
    """Rows every step runs whatever the cut: each request's root, and unscored drafts whole."""
    return sum(1 if tree.chances is not None else tree.num_nodes for tree in trees)


def _chances(trees: list[DraftTree]) -> list[float]:
    """Every scored draft node's chance."""
    return [chance for tree in trees if tree.chances is not None for chance in tree.chances[1:]]


class Stopwatch:
    """Seconds since the last lap."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


@torch.inference_mode()
def calibrate(executor: Executor, kv_layers: list[PagedKV], block_size: int, max_query_len: int | None = None,
              context: int = 64, repeats: int = 3) -> CostModel:
    """The verify-cost table: the seconds of a step over T query tokens, each request's
    after `context` cached ones (kv_layers: the model's per-layer paged caches), run as the
    engine runs its steps (`Executor.run`: on CUDA a captured graph where one holds the
    step), timed on the device's clock (CUDA events there, see step_timer.measure_seconds).
    T tokens are one request's; on CUDA, given max_query_len (the most a request verifies:
    1 + its lookahead), as few requests as hold them: the steps the engine can run there, so
    the graphs captured for them are timed, not eager forwards of shapes no step has. (On the
    CPU every step runs eagerly; one request's rows keep the prior the policy was tuned on.)

    Writes KV into the first blocks of the pool: call it before any request is admitted.
    """
    device = kv_layers[0].k.device
    seconds = []
    for size in CALIBRATION_SIZES:
        per_request = max_query_len if max_query_len and device.type == "cuda" else size
        inputs = _synthetic_step(size, per_request, context, block_size, kv_layers[0].k.shape[0])
        step = partial(executor.run, inputs, kv_layers, device)
        seconds.append(min(measure_seconds(step, device) for _ in range(repeats)))
    return CostModel(list(CALIBRATION_SIZES), seconds)


def _synthetic_step(size: int, max_query_len: int, context: int, block_size: int, pool_blocks: int) -> StepInputs:
    """A step of `size` query tokens in requests of at most max_query_len, each after
    `context` cached ones in blocks of its own, the pool's first ones in order (wrapping
    around a pool of fewer than pool_blocks: the KV written is never read back, only
    timed); every row's logits wanted."""
    inputs = StepInputs([], [], [], [], [], [], [], None, [])
    first_block = 0
    for start in range(0, size, max_query_len):
        query = min(max_query_len, size - start)
        total = context + query
        table = [(first_block + i) % pool_blocks for i in range(-(-total // block_size))]
        positions = list(range(context, total))
        inputs.token_ids += [0] * query
        inputs.positions += positions
        inputs.slots += [table[p // block_size] * block_size + p % block_size for p in positions]
        inputs.query_lens.append(query)
        inputs.seq_lens.append(total)
        inputs.block_tables.append(table)
        inputs.num_rows.append(query)
        first_block += len(table)
    inputs.logit_rows = list(range(size))
    return inputs
