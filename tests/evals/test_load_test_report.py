"""evals/load_test.py's report of the RSS once the KV cache had been filled once, from a
made-up run (no server)."""
from __future__ import annotations

from types import ModuleType

from specdec.cli import load_eval


def _load_test() -> ModuleType:
    module = load_eval("load_test")
    assert module is not None
    return module


def _run(load_test: ModuleType, kv_tokens: int | None) -> object:
    plan = load_test.Plan("/v1/completions", {"speculative": True}, max_tokens=100, cancel_after=None)

    def done(started_at: float, latency: float, prompt: int) -> object:
        return load_test.Outcome(plan, 200, finish_reason="length", prompt_tokens=prompt, completion_tokens=100,
                                 started_at=started_at, latency=latency)

    outcomes = [done(0.0, 2.0, 300), done(1.0, 3.0, 500), done(2.0, 1.0, 100),
                load_test.Outcome(plan, 200, cancelled=True, started_at=0.5, latency=0.2)]  # no usage: not counted
    rss = [(0.5, 500.0), (2.5, 700.0), (3.5, 1400.0), (5.0, 1390.0)]
    return load_test.Run(outcomes, elapsed=6.0, rss=rss, rss_after=1410.0, gauges={}, preemptions=0, spec_decode={},
                         max_model_len=2048, rss_source="/proc", kv_tokens=kv_tokens)


def test_the_rss_once_the_pool_was_filled_is_reported() -> None:
    load_test = _load_test()
    args = load_test.parse_args(["--duration", "6", "--windows", "2"])
    # ends: 2.0 s (400 tokens), 3.0 s (200), 4.0 s (600): 600 tokens are reached at 3.0 s
    summary = load_test.summarize(_run(load_test, kv_tokens=600), args)
    assert summary["kv_filled_at_s"] == 3.0 and summary["rss_kv_filled_mib"] == 1410.0  # the one after the run
    assert "| RSS once the KV cache was filled (MiB; at s) | 1410.0; 3.0 |" in load_test.report_table(summary)
    unknown = load_test.summarize(_run(load_test, kv_tokens=None), args)  # not our server: no pool size
    assert unknown["kv_filled_at_s"] is None and unknown["rss_kv_filled_mib"] is None
