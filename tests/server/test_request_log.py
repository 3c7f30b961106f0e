"""The request log's lines: a request's end is never logged before its admission, even when
the engine finishes it before the admission callback runs."""
from __future__ import annotations

import logging

import pytest

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.parallel_sampling import ParentRequest
from specdec.sampling_params import SamplingParams
from specdec.server.request_log import RequestRecord

NAME = "specdec.server.request_log"


def finished_parent() -> ParentRequest:
    parent = ParentRequest("r1", SamplingParams(max_tokens=2))
    parent.update(RequestOutput("r1", None, [1, 2], [CompletionOutput(0, "ab", [5, 6], "length")], True))
    return parent


def test_an_end_that_arrives_first_waits_for_the_admission(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=NAME)
    record, parent = RequestRecord("r1"), finished_parent()
    record.observe(parent.merged(), parent)
    assert [r.getMessage() for r in caplog.records if r.name == NAME] == []
    record.admitted([1, 2], parent.params, speculative=False)
    lines = [r.getMessage() for r in caplog.records if r.name == NAME]
    assert [line.split()[2] for line in lines] == ["admitted:", "finished:"]


def test_the_end_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=NAME)
    record, parent = RequestRecord("r1"), finished_parent()
    record.admitted([1, 2], parent.params, speculative=True)
    record.observe(parent.merged(), parent)
    record.observe(parent.merged(), parent)
    assert sum("finished:" in r.getMessage() for r in caplog.records if r.name == NAME) == 1
