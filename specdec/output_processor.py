"""Commits sampled tokens to a request one at a time, stopping at exactly the right token,
and shapes a request's state into the RequestOutput callers see."""
from __future__ import annotations

from specdec.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from specdec.request import Request


def commit_tokens(request: Request, token_ids: list[int], max_model_len: int) -> int:
    """Append tokens until one of them stops the request; return how many were kept."""
    for count, token_id in enumerate(token_ids, start=1):
        delta = request.append_token(token_id)
        if check_stop(request, token_id, len(delta), max_model_len):
            return count
    return len(token_ids)


def check_stop(request: Request, token_id: int, delta_len: int, max_model_len: int) -> bool:
    """Set finish_reason / stop_reason if the token just appended ends the request."""
    params = request.sampling_params
    min_reached = request.num_output_tokens >= params.min_tokens
    if min_reached and not params.ignore_eos and token_id in request.eos_token_ids:
        return _finish(request, "stop", None)
    if min_reached and token_id in (params.stop_token_ids or []):
        return _finish(request, "stop", token_id)
    if min_reached and _match_stop_string(request, delta_len):
        return True
    # Tokens appended so far: a token still on the device (overlap scheduling) comes later.
    if request.num_output_tokens >= request.max_tokens or len(request.all_token_ids) >= max_model_len:
        return _finish(request, "length", None)
    return False


def _match_stop_string(request: Request, delta_len: int) -> bool:
    detok = request.detokenizer
    params = request.sampling_params
    if detok is None or not params.stop_strings:
        return False
    longest = max(len(s) for s in params.stop_strings)
    # Only the new text, plus enough before it to catch a stop string straddling tokens.
    window_start = max(0, len(detok.text) - delta_len - longest + 1)
    for stop in params.stop_strings:
        index = detok.text.find(stop, window_start)
        if index >= 0:
            end = index + len(stop) if params.include_stop_str_in_output else index
            detok.text = detok.text[:end]
            return _finish(request, "stop", stop)
    return False


def _finish(request: Request, reason: str, stop_reason: int | str | None) -> bool:
    request.finish_reason = reason
    request.stop_reason = stop_reason
    return True


def visible_text(request: Request) -> str:
    """Text safe to show now: while running, hold back what could begin a stop string."""
    text = request.text
    stops = request.sampling_params.stop_strings
    if request.finish_reason is not None or not stops:
        return text
    hold = max(len(s) for s in stops) - 1
    return text[: max(0, len(text) - hold)]


def make_output(request: Request) -> RequestOutput:
    logprobs = (request.output_logprobs[: request.num_output_tokens]
                if request.sampling_params.logprobs is not None else None)
    completion = CompletionOutput(
        index=0,
        text=visible_text(request),
        token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=logprobs,
        cumulative_logprob=None if logprobs is None else cumulative_logprob(logprobs, request.output_token_ids),
    )
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[completion],
        finished=request.finish_reason is not None,
        metrics=_metrics(request),
        error=request.error,
    )


def _metrics(request: Request) -> dict[str, float]:
    """Per-request counters, and vLLM v1's `first_token_latency` (seconds from arrival to
    the first output token) once a token is out."""
    metrics = {"num_cached_tokens": float(request.num_cached_tokens),
               "num_preemptions": float(request.num_preemptions)}
    if request.first_token_latency is not None:
        metrics["first_token_latency"] = request.first_token_latency
    return metrics


def cumulative_logprob(logprobs: SampleLogprobs, token_ids: list[int]) -> float:
    """The sum of the sampled tokens' logprobs, as vLLM reports it."""
    return sum(entry[token_id].logprob for entry, token_id in zip(logprobs, token_ids))

