"""Overlap scheduling (EngineConfig.async_scheduling): the host schedules and launches step
n+1 before it reads step n's sampled tokens back, so the device never waits for the host
between steps (vLLM v1's async scheduling, SGLang's overlap scheduler).

How a step of root-only trees (plain decode, prefill chunks, requests without drafts) runs:

- Its tokens are sampled on the device (`sample_roots`) and stay there; a copy to the host
  starts at once without waiting (pinned memory and an event on CUDA). The engine keeps
  the step in flight (`Pipeline.keep`) and advances each request's `num_computed_tokens`;
  a request whose token is still on the device counts it in `Request.num_pending`.
- The next step schedules such a request as decoding one unknown root token: the model
  runner gathers it from the in-flight step's device tokens into the forward's input ids
  (`Pipeline.feed`, a device-side scatter into the input buffer or the CUDA graph's static
  one; `model_runner.Feed`).
- Once that forward is launched, the engine reads the in-flight step's tokens (the device
  finished them before it began the new forward) and commits them as any step's: stop
  checks, streaming, logprobs, KV bookkeeping. Only then does it sample the new step, so
  logits processors (penalties, grammar masks) see every token before the one they decide,
  exactly as without overlap.
- A request that stopped (or was aborted) at step n was already in step n+1: its extra
  token is dropped unread, its KV blocks were freed when it finished. A request preempted
  while its token was on the device keeps the token (its logits were computed before the
  preemption) and is recomputed later from its real tokens: the scheduler admits no waiting
  request with a token still pending, so no placeholder is ever recomputed. A request sure
  to end when its pending token lands (max_tokens reached) is not scheduled again.
- KV slots for drafts are reserved only for what a step verifies (`LLMEngine._reserve_drafts`),
  and a step left in flight verifies none: it holds no slot the next step could need.
- A request whose logits processing fails (a grammar) ends when its step is launched: it
  has no token to feed the next step. A forward that fails commits the step in flight
  first, then fails its requests, as the synchronous engine would have.
- Drafters that read the target's captured features (EAGLE-3) get them with each step's
  commit: with feature capture on, no step is left in flight.

What does not overlap:

- Drafting after a step in flight. The speculation policy's grants do not depend on the
  tokens (they weigh acceptance statistics and step costs), so the scheduler grants with
  tokens still on the device. When it grants drafts to a request whose last token is
  there, the engine reads the step in flight back before drafting (`Pipeline.must_settle`):
  the drafter's host lookups (n-gram, suffix), its draft model or heads, and grammar-forced
  drafts all key on that token, so they cannot run while the device computes it. Steps in
  which speculating requests are granted nothing (most steps of open text under adaptive
  speculation) overlap like plain decoding.
- Verify steps: verified on the host at once (their accepted tokens decide the next
  drafts), so the step after one starts from known tokens.
- Reading a step's logprobs, and grammar masks whose rows end up empty, wait for the
  device: such steps are correct but overlap less.

Sampling a root-only row here is what `specdec.spec.verify.verify` does for it (argmax for
greedy rows; for sampled rows the exponential race, keyed by position for seeded ones), so
greedy and seeded outputs are identical with and without overlap (tests/engine/test_overlap.py).

With CUDA graphs a decode step's rows are sampled inside its graph, the same way
(specdec/graph_sampling.py): `Pipeline.feed` decides once per step, from the batch's params,
which rows the graph samples (`plan_sampling`), and `sample_roots` takes those rows' tokens
from the graph and samples only the others (logits processors, grammars, top-k / top-p /
min-p) from the logits, as above. A step that replays no decode graph samples every row here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.graph_sampling import NO_TOKEN, RootSampling, plan_rows
from specdec.logits_processors import process_logits
from specdec.model_runner import Feed, ForwardOutput
from specdec.sampler import SamplingTensors, argmax, logits_to_probs, sample_keyed, sample_probs, top_logprobs
from specdec.scheduler import ScheduledRequest
from specdec.spec.tree import DraftTree
from specdec.spec.verify import Verified, row_starts


@dataclass
class SampledStep:
    """A step of root-only trees whose tokens were sampled on the device and are read back
    later (`results`)."""

    batch: list[ScheduledRequest]
    trees: list[DraftTree]
    output: ForwardOutput
    tokens: Tensor  # [B] int64 on the device: each request's sampled token, NO_TOKEN where none
    host_tokens: Tensor  # [B] int64 on the host, filled by a copy that did not wait (see `ready`)
    ready: torch.cuda.Event | None  # recorded after that copy on CUDA; None on the CPU
    faults: dict[int, str]  # batch index -> why its logits processing failed (ended at launch, Pipeline.faults)
    rows: dict[int, int]  # id(request) -> batch index

    def results(self) -> list[Verified]:
        """Per request what `verify` returns for a root-only tree: its token (none
        mid-prefill) with its logprobs and hidden state, or its fault."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host_tokens.tolist()
        results, row = [], 0
        for i, (item, num_rows) in enumerate(zip(self.batch, self.output.num_rows)):
            results.append(self._result(i, item, tokens[i], row) if num_rows else Verified())
            row += num_rows
        return results

    def _result(self, i: int, item: ScheduledRequest, token: int, row: int) -> Verified:
        if i in self.faults:
            return Verified(error=self.faults[i])
        result = Verified(tokens=[token], hidden=self.output.hidden[row])
        num_top = item.request.sampling_params.logprobs
        if num_top is not None and not item.request.is_finished:  # from the raw logits, as verify's
            detokenizer = item.request.detokenizer
            decode = detokenizer.decode_token if detokenizer is not None else None
            result.logprobs = top_logprobs(self.output.logits[row:row + 1], torch.tensor([token]), num_top, decode)
        return result


def sample_roots(batch: list[ScheduledRequest], trees: list[DraftTree], output: ForwardOutput) -> SampledStep:
    """Sample every request's one logits row on the device (trees are roots alone) and
    start copying the tokens to the host; nothing here waits for the device but a
    grammar's empty-row check. Rows the step's graph sampled (output.sampled) are taken
    as they are."""
    device = output.logits.device
    logits, faults = process_logits(output.logits, [item.request for item in batch], trees,
                                    output.num_rows)  # [R, V]
    starts = row_starts(output.num_rows)
    done = set(output.sampled.rows) if output.sampled is not None else set()
    active = [i for i, n in enumerate(output.num_rows) if n and i not in faults and i not in done]
    if output.sampled is not None:  # [B] NO_TOKEN outside `done`; a copy made out of inference mode to write in
        tokens = output.sampled.tokens.clone() if active else output.sampled.tokens
    else:
        tokens = torch.full((len(batch),), NO_TOKEN, dtype=torch.int64, device=device)  # [B]
    greedy = [i for i in active if batch[i].request.sampling_params.greedy]
    if greedy:
        tokens[_index(greedy, device)] = argmax(logits[_index([starts[i] for i in greedy], device)])
    seeded = [i for i in active if i not in greedy and batch[i].request.sampling_params.seed is not None]
    if seeded:
        tokens[_index(seeded, device)] = _sample(batch, logits, starts, seeded, keyed=True)
    unseeded = [i for i in active if i not in greedy and i not in seeded]
    if unseeded:
        tokens[_index(unseeded, device)] = _sample(batch, logits, starts, unseeded, keyed=False)
    host_tokens, ready = _start_copy(tokens)
    return SampledStep(list(batch), list(trees), output, tokens, host_tokens, ready, faults,
                       {id(item.request): i for i, item in enumerate(batch)})


def _sample(batch: list[ScheduledRequest], logits: Tensor, starts: list[int], rows: list[int],
            keyed: bool) -> Tensor:  # logits [R, V] -> [len(rows)] int64
    """The given requests' tokens by the exponential race over their transformed
    distributions; a seeded row's exponentials keyed by the position it decides (the one
    after its root), as the verifier keys them."""
    params = [batch[i].request.sampling_params for i in rows]
    probs = logits_to_probs(logits[_index([starts[i] for i in rows], logits.device)],
                            SamplingTensors.from_params(params))  # [N, V]
    if not keyed:
        return sample_probs(probs, [None] * len(rows))
    seeds = [p.seed for p in params if p.seed is not None]
    positions = [batch[i].request.num_computed_tokens + batch[i].num_new_tokens for i in rows]
    return sample_keyed(probs, seeds, positions)


def _start_copy(tokens: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:  # [B] -> host [B], its event
    """A host copy of the device tokens that does not wait for the device: into pinned
    memory behind an event on CUDA; on the CPU the tensor is already there."""
    if tokens.device.type != "cuda":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _index(values: list[int], device: torch.device) -> Tensor:  # [N] int64 on `device`
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


class Pipeline:
    """The step in flight, if any: with overlap on, each step of root-only trees stays
    here until the next step's forward is launched (`keep`, `take`); with it off, nothing
    is ever kept and the engine runs every step to its end."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight: SampledStep | None = None

    def overlaps(self, trees: Sequence[DraftTree], output: ForwardOutput) -> bool:
        """Whether a step with these trees is left in flight: overlap is on, nothing was
        drafted (a verify step is read at once: its drafter needs its tokens next) and no
        drafter reads the step's captured features (EAGLE-3: committed with the step)."""
        return self.enabled and not any(tree.num_drafts for tree in trees) and output.features is None

    def keep(self, step: SampledStep) -> None:
        assert self.in_flight is None, "the step before was not committed"
        self.in_flight = step

    def take(self) -> SampledStep | None:
        """The step in flight, handed over to be committed."""
        step, self.in_flight = self.in_flight, None
        return step

    def faults(self) -> dict[int, str]:
        """The step in flight's requests whose logits processing failed (batch index -> what
        their client is told): they have no token to feed the next step, so they end at
        once instead of when the step is committed."""
        return self.in_flight.faults if self.in_flight is not None else {}

    def must_settle(self, batch: Sequence[ScheduledRequest]) -> bool:
        """Before drafting: a request granted drafts has its last token still on the
        device, and its drafter (and grammar) must read it. The grants themselves do not
        depend on the tokens, so a step that grants no such request overlaps."""
        return any(item.num_draft_tokens and item.request.num_pending for item in batch)

    def feed(self, batch: Sequence[ScheduledRequest]) -> Feed | None:
        """The root tokens of `batch`'s requests that are still on the device (gathered
        there from the step in flight, for the model runner to scatter into the inputs),
        and which rows a decode graph is to sample (`plan_sampling`)."""
        sampling = plan_sampling(batch) if self.enabled else None
        step = self.in_flight
        fed = [i for i, item in enumerate(batch) if item.request.num_pending]
        if not fed:
            return None if sampling is None else Feed([], torch.zeros(0, dtype=torch.int64), sampling)
        assert step is not None, "a token is pending but no step is in flight"
        source = [step.rows[id(batch[i].request)] for i in fed]
        return Feed(fed, step.tokens[_index(source, step.tokens.device)], sampling)


def plan_sampling(batch: Sequence[ScheduledRequest]) -> RootSampling | None:
    """Which of a step's rows its decode graph samples (graph_sampling.samples_in_graph),
    decided from the batch's params before the forward; None where no decode graph will
    replay the step (a prefill chunk, or drafts may be granted: a verify step samples on the
    host) or no row qualifies. A seeded row is keyed by the position it decides, the one
    after its root (as `_sample`)."""
    if any(item.num_draft_tokens or item.num_new_tokens != 1 for item in batch):
        return None
    plan = plan_rows([item.request for item in batch], [item.completes_prompt for item in batch],
                     [item.request.num_computed_tokens + item.num_new_tokens for item in batch])
    return plan if plan.rows else None
