"""Sampling a decode step inside its CUDA graph (specdec/cuda_graphs.py), for overlap
scheduling (specdec/overlap.py): the graph of a decode shape runs the forward, the LM head
and each row's sampling, so the step is one graph launch whose output is the sampled
token ids, which the next step's Feed gathers into its input ids on the device.

The graph samples a row exactly as `overlap.sample_roots` does on the host path: the
argmax for greedy rows (kernels/triton_sample.py's on the triton backend), and for rows
sampled at a temperature the exponential race argmax(softmax(logits / T) / E), with
E keyed by (seed, position) for seeded rows and drawn on the device for the others. Its
per-row inputs live in static buffers the host fills before the replay (`GraphSampler.fill`):
the temperature, whether the graph decides the row, and the keyed exponentials, drawn on
the host by the same generator the host path uses. So the tokens are the host path's, and
nothing waits for the device.

What the graph cannot do (logits processors: penalties, bias, bans, min_tokens, grammars;
top-k, top-p, min-p) stays on the host path for that row (`samples_in_graph`): the graph
leaves it NO_TOKEN and `sample_roots` samples it from the step's logits.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.logits_processors import needs_processing
from specdec.request import Request
from specdec.sampler import argmax, keyed_race_noise

NO_TOKEN = -1  # a request the step decided no token for (mid-prefill, a fault, or left to the host path)


def samples_in_graph(request: Request) -> bool:
    """Whether a decode graph can sample this request's row as the host path would: no
    logits processing, no grammar, and no top-k / top-p / min-p on a sampled row."""
    params = request.sampling_params
    if needs_processing(params) or request.grammar is not None:
        return False
    return params.greedy or (params.top_k == 0 and params.top_p == 1.0 and params.min_p == 0.0)


@dataclass
class RootSampling:
    """How a decode step's graph samples each request's row, decided once per step from the
    batch's params (overlap.plan_sampling), before the forward is launched."""

    rows: list[int]  # batch indices the graph samples; the others get NO_TOKEN
    temperature: list[float]  # [B] 0 on greedy rows and on rows not sampled in the graph
    keys: list[tuple[int, int] | None]  # [B] (seed, position decided) of a seeded sampled row


@dataclass
class GraphTokens:
    """A replayed decode step's sampled tokens (ForwardOutput.sampled)."""

    tokens: Tensor  # [B] int64 on the device: NO_TOKEN outside `rows`
    rows: list[int]  # batch indices the graph sampled (RootSampling.rows)


class GraphSampler:
    """The static inputs of the in-graph sampler, sized for the largest decode batch, and
    the sampling the graphs capture (`sample`)."""

    def __init__(self, max_batch: int, vocab: int, device: torch.device, use_triton: bool) -> None:
        self.device = device
        self.temperature = torch.zeros(max_batch, dtype=torch.float32, device=device)  # 0: greedy
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=device)  # the graph decides the row
        self.noise = torch.ones(max_batch, vocab, dtype=torch.float32, device=device)  # the race's exponentials
        self.argmax: Callable[[Tensor], Tensor] = argmax
        if use_triton:  # imported here: importing triton is slow, and the CPU engine never needs it
            from specdec.kernels.triton_sample import argmax_triton

            self.argmax = argmax_triton

    def sample(self, logits: Tensor) -> Tensor:  # [B, V] float32 -> [B] int64
        """Every row's token from the static inputs (captured: no host sync). Both the
        argmax and the race run on every row and each row takes its own; the race's
        operations are the host path's (sampler.logits_to_probs, sample_probs), so its
        bits are too."""
        b = logits.shape[0]
        temperature = self.temperature[:b]
        greedy = temperature == 0
        scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)  # [B, V]
        probs = torch.softmax(scaled, dim=-1)  # [B, V]
        race = self.noise[:b].clamp_(min=torch.finfo(torch.float32).tiny)  # as sample_probs: no 0/0
        tokens = torch.where(greedy, self.argmax(logits), self.argmax(probs.div_(race)))  # [B]
        return torch.where(self.active[:b], tokens, NO_TOKEN)

    def fill(self, plan: RootSampling, batch_size: int) -> None:
        """Write a step's plan into the static inputs of a `batch_size` graph (dummy
        requests greedy and inactive); the copies queue behind the device's work."""
        pad = batch_size - len(plan.temperature)
        active = [False] * (len(plan.temperature) + pad)
        for row in plan.rows:
            active[row] = True
        self.temperature[:batch_size].copy_(torch.tensor(plan.temperature + [0.0] * pad, dtype=torch.float32),
                                            non_blocking=True)
        self.active[:batch_size].copy_(torch.tensor(active), non_blocking=True)
        self._fill_noise(plan)

    def _fill_noise(self, plan: RootSampling) -> None:
        sampled = [row for row in plan.rows if plan.temperature[row] > 0]
        if any(plan.keys[row] is None for row in sampled):  # unseeded rows race on device noise
            self.noise[: len(plan.temperature)].exponential_()
        vocab = self.noise.shape[1]
        for row in sampled:
            key = plan.keys[row]
            if key is not None:  # seeded rows' noise overwrites: the host path's keyed draw
                self.noise[row].copy_(_staged(keyed_race_noise(*key, vocab), self.device), non_blocking=True)


def _staged(values: Tensor, device: torch.device) -> Tensor:  # [V] on the host
    """Pinned on CUDA, so the copy to the device does not wait for it."""
    return values.pin_memory() if device.type == "cuda" else values


def plan_rows(requests: Sequence[Request], has_row: Sequence[bool],
              positions: Sequence[int]) -> RootSampling:
    """The plan for a batch: request i has a logits row when has_row[i], and that row
    decides the token at positions[i] (the key of a seeded row)."""
    rows = [i for i, (request, row) in enumerate(zip(requests, has_row, strict=True))
            if row and samples_in_graph(request)]
    temperature, keys = [0.0] * len(requests), list[tuple[int, int] | None]([None] * len(requests))
    for i in rows:
        params = requests[i].sampling_params
        if not params.greedy:
            temperature[i] = params.temperature
            keys[i] = None if params.seed is None else (params.seed, positions[i])
    return RootSampling(rows, temperature, keys)
