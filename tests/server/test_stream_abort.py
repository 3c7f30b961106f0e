"""The "abort" chunks that end a stream the server cut short (streaming.py): one per choice
not finished yet, shaped as each route's chunks, and only for aborts, not other failures.
The whole stream is tested in test_shutdown.py (a deadline) and test_ray.py (a replica's death)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from specdec.async_engine import RequestStream
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.server.chat import ChatStreamer
from specdec.server.completions import CompletionStreamer
from specdec.server.jobs import Job, failure
from specdec.server.streaming import was_aborted


def _output(*reasons: str | None, error: str | None = None) -> RequestOutput:
    outputs = [CompletionOutput(i, "ab", [1, 2], reason) for i, reason in enumerate(reasons)]
    return RequestOutput("r", "p", [0], outputs, finished=all(r is not None for r in reasons), error=error)


def test_only_an_abort_gets_abort_chunks() -> None:
    assert was_aborted(_output("abort", "abort")) and failure(_output("abort")) is not None
    assert was_aborted(_output("length", "abort"))  # one choice had finished before
    assert not was_aborted(_output("error", "abort"))  # an engine failure: its error event alone
    assert not was_aborted(_output("abort", error="boom"))
    assert not was_aborted(_output("length", "stop")) and not was_aborted(_output(None))


def _streamer(kind: type[Any], prompts: int, n: int) -> Any:
    # The streamers never read the streams: stand-ins, one per prompt.
    job = Job("id-1", n, created=7, streams=cast("list[RequestStream]", [object()] * prompts))
    state = SimpleNamespace(model_name="tiny")
    return kind(state, job, True, 0) if kind is ChatStreamer else kind(state, job, False, False)


def test_each_unfinished_completion_choice_ends_once() -> None:
    streamer = _streamer(CompletionStreamer, prompts=2, n=2)
    streamer.tracker.deltas(0, _output("length", None))  # choice 0 finished, 1 under way; 2 and 3 not started
    chunks = streamer.aborted()
    assert [c["choices"] for c in chunks] == [[{"index": i, "text": "", "logprobs": None, "finish_reason": "abort"}]
                                              for i in (1, 2, 3)]
    assert all(c["id"] == "id-1" and c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert streamer.aborted() == []  # finish_reason exactly once


def test_each_unfinished_chat_choice_ends_with_an_empty_delta() -> None:
    streamer = _streamer(ChatStreamer, prompts=1, n=2)
    chunks = streamer.aborted()
    assert [c["choices"] for c in chunks] == [[{"index": i, "delta": {}, "logprobs": None, "finish_reason": "abort"}]
                                              for i in (0, 1)]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)  # include_usage
