"""Parallel sampling (n > 1): one parent request fans out into n child requests.

The engine only runs single-completion requests. A request with `n` completions runs as
`n` children `{id}-{i}` with `n=1` and seed `seed + i` (distinct but reproducible
samples), and their outputs merge back into one RequestOutput whose completions are
indexed 0..n-1, as vLLM v1's ParentRequest does. A request with n == 1 is its own only
child, under its own id, so nothing changes for it.

Used by both the offline `LLM` and the server's `AsyncEngine`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams

Prompt = str | list[int]


class ChildEngine(Protocol):
    """The part of LLMEngine that fanning out needs."""

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    use_speculation: bool = True, grammar: Any = None) -> Any: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...


@dataclass(frozen=True)
class ChildRequest:
    request_id: str
    index: int  # the completion index this child fills in the merged output
    params: SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The SamplingParams of child `index`: one completion, seed offset by the index."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


class ParentRequest:
    """One request with `params.n` completions, and the latest output of each child.

    The child list is fixed at construction, so it may be read from any thread; `update`
    and `merged` keep per-child state and belong to one thread (the caller's).
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.children: tuple[ChildRequest, ...] = tuple(
            ChildRequest(request_id if params.n == 1 else f"{request_id}-{i}", i, child_params(params, i))
            for i in range(params.n)
        )
        self._index = {child.request_id: child.index for child in self.children}
        self._latest: list[RequestOutput | None] = [None] * params.n

    @property
    def child_ids(self) -> list[str]:
        return [child.request_id for child in self.children]

    def add_to(self, engine: ChildEngine, prompt: Prompt, use_speculation: bool = True, grammar: Any = None) -> None:
        """Add every child to `engine` (`grammar`: their constraint, compiled already). If the
        engine refuses one (a bad prompt), the children already added are aborted, so none
        is left running, and the error is raised."""
        added: list[str] = []
        try:
            for child in self.children:
                engine.add_request(child.request_id, prompt, child.params, use_speculation, grammar)
                added.append(child.request_id)
        except BaseException:
            for request_id in added:
                engine.abort_request(request_id)
            raise

    def abort_in(self, engine: ChildEngine) -> None:
        """Abort every child in `engine` (children it does not know are skipped)."""
        for child in self.children:
            engine.abort_request(child.request_id)

    def update(self, output: RequestOutput) -> None:
        """Record a child's newest output. Outputs are cumulative, so only the newest is kept."""
        self._latest[self._index[output.request_id]] = output

    @property
    def finished(self) -> bool:
        return all(output is not None and output.finished for output in self._latest)

    def merged(self) -> RequestOutput:
        """The children's newest outputs as one RequestOutput with completions 0..n-1; a
        child that has produced nothing yet shows as an empty completion."""
        return merge_outputs(self.request_id, self._latest, with_logprobs=self.params.logprobs is not None)


def merge_outputs(request_id: str, outputs: Sequence[RequestOutput | None], with_logprobs: bool) -> RequestOutput:
    """Merge per-child outputs (None: nothing yet) into one; at least one must be present.

    Completions are copied, not re-indexed in place: the engine may still hold them.
    """
    first = next((o for o in outputs if o is not None), None)
    if first is None:
        raise ValueError(f"request {request_id!r} has no output to merge yet")
    completions = [_completion(i, o, with_logprobs) for i, o in enumerate(outputs)]
    return RequestOutput(
        request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids, outputs=completions,
        finished=all(o is not None and o.finished for o in outputs), metrics=first.metrics,
        error=next((o.error for o in outputs if o is not None and o.error), None),
    )


def _completion(index: int, output: RequestOutput | None, with_logprobs: bool) -> CompletionOutput:
    if output is None:
        return CompletionOutput(index, "", [], logprobs=[] if with_logprobs else None)
    return replace(output.outputs[0], index=index)
