"""The vllm:* twins on /metrics after real requests, as vLLM dashboards and the llm-d /
Gateway API inference scheduler read them (vllm:num_requests_waiting, vllm:kv_cache_usage_perc),
parsed with prometheus_client's own parser."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from specdec.server.metrics import token_buckets
from tests.helpers import RunningServer, all_blocks_free, slow_engine_steps, start_server, start_streams, wait_until

MODEL = "tiny-metrics"
K = 3  # draft tokens per step
LONG = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 40, "ignore_eos": True, "temperature": 0.0,
        "speculative": False, "stream": True}


@pytest.fixture(scope="module")
def busy_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """One request runs at a time, so a second one waits: the scheduler gauges move."""
    running = start_server(tiny_model_dir, MODEL, None, max_num_seqs=1,
                           speculative_config={"method": "ngram", "num_speculative_tokens": K})
    yield running
    running.stop()


def scrape(server: RunningServer) -> list[Sample]:
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.status_code == 200
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return float(found[0])


def stats_now(server: RunningServer) -> dict[str, float]:
    return dict(server.async_engine.stats)


def test_scheduler_gauges_while_busy(busy_server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    slow_engine_steps(busy_server, monkeypatch, seconds=0.02)
    readers = start_streams(f"{busy_server.base_url}/v1/completions", LONG, 2)
    assert wait_until(lambda: stats_now(busy_server)["num_requests_waiting"] == 1)
    busy = scrape(busy_server)
    for reader in readers:
        reader.join(timeout=30)
        assert reader.status == 200
    # one scrape renders one engine snapshot: the twins agree, and the scheduler had one of each
    assert value(busy, "vllm:num_requests_waiting", model_name=MODEL) == 1
    assert value(busy, "vllm:num_requests_running", model_name=MODEL) == 1
    usage = value(busy, "vllm:kv_cache_usage_perc", model_name=MODEL)
    assert 0 < usage < 1 and usage == value(busy, "specdec:kv_cache_usage_perc")
    assert wait_until(lambda: all_blocks_free(busy_server) and stats_now(busy_server)["num_requests_running"] == 0)
    idle = scrape(busy_server)
    assert value(idle, "vllm:num_requests_waiting", model_name=MODEL) == 0
    assert value(idle, "vllm:kv_cache_usage_perc", model_name=MODEL) == 0


def test_counters_and_histograms_after_requests(busy_server: RunningServer) -> None:
    before = scrape(busy_server)
    prompt = "def add(a, b):\n    return a + b\n" * 3
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 2}
    response = httpx.post(f"{busy_server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    usage = response.json()["usage"]
    target = value(before, "specdec:generation_tokens_total") + usage["completion_tokens"]
    assert wait_until(lambda: busy_server.async_engine.stats["num_generation_tokens"] >= target)
    after = scrape(busy_server)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    model = {"model_name": MODEL}
    # n=2 runs as two engine requests, each prefilling the prompt (usage counts it once)
    prompt_tokens = 2 * usage["prompt_tokens"]
    assert grew("vllm:prompt_tokens_total", **model) == prompt_tokens == grew("specdec:prompt_tokens_total")
    assert grew("vllm:generation_tokens_total", **model) == usage["completion_tokens"] == 24
    assert grew("vllm:request_success_total", finished_reason="length", **model) == 2
    assert grew("vllm:request_generation_tokens_count", **model) == 2
    assert grew("vllm:request_generation_tokens_sum", **model) == 24
    assert grew("vllm:request_prompt_tokens_sum", **model) == prompt_tokens
    assert grew("vllm:time_to_first_token_seconds_count", **model) == 1
    assert grew("vllm:e2e_request_latency_seconds_count", **model) == 1
    assert grew("vllm:spec_decode_num_drafts_total", **model) > 0
    # with prefix caching on, both requests looked their prompt up (the second may find the first's blocks)
    looked_up = prompt_tokens if busy_server.engine.config.enable_prefix_caching else 0
    assert grew("vllm:prefix_cache_queries_total", **model) == looked_up
    assert 0 <= grew("vllm:prefix_cache_hits_total", **model) <= looked_up
    # the twins are moved by the same data: equal at every scrape
    for ours, theirs in [("specdec:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
                         ("specdec:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
                         ("specdec:spec_decode_num_accepted_tokens_total",
                          "vllm:spec_decode_num_accepted_tokens_total"),
                         ("specdec:num_preemptions_total", "vllm:num_preemptions_total"),
                         ("specdec:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
                         ("specdec:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
                         ("specdec:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count")]:
        assert value(after, ours) == value(after, theirs, **model), theirs
    per_pos = [value(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p), **model)
               for p in range(K)]
    assert sum(per_pos) == value(after, "vllm:spec_decode_num_accepted_tokens_total", **model)


def test_every_vllm_sample_has_the_model_label_and_vllm_buckets(busy_server: RunningServer) -> None:
    samples = scrape(busy_server)
    twins = [s for s in samples if s.name.startswith("vllm:")]
    assert twins and all(s.labels.get("model_name") == MODEL for s in twins)
    ttft = [s.labels["le"] for s in twins if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert ttft[-2:] == ["2560.0", "+Inf"]
    prompt_buckets = [s.labels["le"] for s in twins if s.name == "vllm:request_prompt_tokens_bucket"]
    assert prompt_buckets == [f"{float(b)}" for b in token_buckets(128)] + ["+Inf"]
    reasons = {s.labels["finished_reason"] for s in twins if s.name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort"}


def test_token_buckets_are_vllms() -> None:
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(4) == [1, 2]
