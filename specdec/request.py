"""One generation request as the engine tracks it (vLLM v1: only num_computed_tokens)."""
from __future__ import annotations

import time
from enum import Enum, auto

import torch

from specdec.detokenizer import IncrementalDetokenizer
from specdec.outputs import SampleLogprobs
from specdec.sampling_params import SamplingParams
from specdec.structured_output import Grammar


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None,
        max_tokens: int,
        eos_token_ids: set[int],
        use_speculation: bool = True,
        prompt: str | None = None,
        grammar: Grammar | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.detokenizer = detokenizer
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.use_speculation = use_speculation
        self.grammar = grammar  # structured outputs: the constraint, in step with the output
        self.output_token_ids: list[int] = []
        self.output_logprobs: SampleLogprobs = []  # one {token_id: Logprob} per token, when asked for
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Sampled tokens still on the device (overlap scheduling, specdec/overlap.py): the
        # scheduler counts them as known tokens, whose ids only the device has until the
        # engine reads them back and appends them.
        self.num_pending = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks, memoised
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None  # monotonic, once the first output token is committed
        # A sequential stream for a drafter that samples its own guesses (the draft model's
        # shadow requests). The verifier does not use it: a seeded request's target draws
        # are keyed by position (specdec.sampler.keyed_generator), whatever was drafted.
        self.generator = _generator(sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        """Known tokens, those still on the device included (`num_pending`)."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def ends_when_settled(self) -> bool:
        """Its pending tokens reach max_tokens: it ends once they are read back, so no
        step need run for it meanwhile."""
        return self.num_pending > 0 and self.num_output_tokens + self.num_pending >= self.max_tokens

    @property
    def is_decoding(self) -> bool:
        """Every known token but the last is in the KV cache: the next step may verify."""
        return self.num_tokens - self.num_computed_tokens == 1

    def append_token(self, token_id: int) -> str:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        return self.detokenizer.append(token_id) if self.detokenizer else ""

    @property
    def first_token_latency(self) -> float | None:
        """Seconds from arrival to the first output token (queueing and prefill), once there is one."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""


def _generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed)
