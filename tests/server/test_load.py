"""evals/load_test.py, short: 16 streaming clients for a few seconds against the test
server (tiny checkpoint, n-gram speculation, a 64-block KV pool that the load overflows)."""
from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest

from specdec.cli import load_eval
from tests.helpers import API_KEY, RunningServer, all_blocks_free


@pytest.fixture(scope="module")
def load_test() -> ModuleType:
    module = load_eval("load_test")
    assert module is not None
    return module


def run_load(load_test: ModuleType, server: RunningServer, capsys: pytest.CaptureFixture[str],
             *extra: str) -> tuple[int, dict[str, Any]]:
    # Prompts of up to 20 words (~60 tokens) and 40 outputs: 16 clients want more than 64 blocks.
    code = load_test.main(["--base-url", server.base_url, "--api-key", API_KEY, "--clients", "16",
                           "--max-prompt-words", "20", "--max-tokens", "40", "--settle-timeout", "10", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out[: out.index("\n| load test |")])


def test_short_load_run_passes_every_check(load_test: ModuleType, server: RunningServer,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = run_load(load_test, server, capsys, "--duration", "5", "--max-rss-growth-mb", "100")
    assert code == 0, summary["checks"]
    assert summary["ok"] and all(check["ok"] for check in summary["checks"].values())
    assert summary["completed"] > 16 and summary["cancelled"] > 0 and summary["non_speculative"] > 0
    assert summary["preemptions"] > 0  # the pool overflowed, and everything still finished
    assert summary["spec_decode"]["num_drafts"] > 0
    assert summary["rss_source"] == "/metrics" and summary["rss_first_half_mib"] > 0
    assert all_blocks_free(server)


def test_a_failed_check_exits_nonzero(load_test: ModuleType, server: RunningServer,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = run_load(load_test, server, capsys, "--duration", "1", "--max-rss-growth-mb", "-1")
    assert code == 1 and not summary["ok"]
    assert [name for name, check in summary["checks"].items() if not check["ok"]] == ["rss_flat"]


def test_finish_reason_must_match_usage(load_test: ModuleType) -> None:
    plan = load_test.Plan("/v1/completions", {}, max_tokens=8, cancel_after=None)

    def problem(reason: str, tokens: int, prompt: int = 10) -> str | None:
        outcome = load_test.Outcome(plan, 200, finish_reason=reason, prompt_tokens=prompt, completion_tokens=tokens)
        return load_test.finish_problem(outcome, 128)

    assert problem("length", 8) is None and problem("stop", 3) is None and problem("stop", 8) is None
    assert problem("length", 5, prompt=123) is None  # max_model_len reached first
    assert problem("length", 5) and problem("stop", 9) and problem("abort", 3)


def test_serve_command(load_test: ModuleType) -> None:
    args = load_test.parse_args(["--start-server", "--speculative-config", '{"method": "ngram"}',
                                 "--server-args", "--max-model-len 512 --enable-prefix-caching"])
    command = load_test.serve_command(args, 8123)
    assert command[1:] == ["-m", "specdec.cli", "serve", "smollm2-135m-instruct", "--port", "8123",
                           "--speculative-config", '{"method": "ngram"}', "--max-model-len", "512",
                           "--enable-prefix-caching"]
