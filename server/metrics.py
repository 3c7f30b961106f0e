"""Prometheus metrics of one server, on a registry of its own (vLLM-style names).

Latency histograms are observed as outputs reach the event loop. Engine counters are
advanced from the deltas of the engine's cumulative `get_metrics()` snapshot, and the
gauges are set from it, at scrape time. prometheus_client exposes a counter `x` as the
sample `x_total` (its HELP/TYPE lines keep the bare name `x`). The standard `process_*`
metrics (resident memory, CPU time, open fds) come along, so load tests can watch the
server's memory from outside.
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdec.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)

# counter name -> key of the engine's get_metrics()
_ENGINE_COUNTERS = {
    "specdec:prompt_tokens_total": ("num_prompt_tokens", "Prompt tokens processed."),
    "specdec:generation_tokens_total": ("num_generation_tokens", "Generated (committed) tokens."),
    "specdec:spec_decode_num_drafts": ("num_drafts", "Verify steps that carried draft tokens."),
    "specdec:spec_decode_num_draft_tokens": ("num_draft_tokens", "Draft tokens proposed."),
    "specdec:spec_decode_num_accepted_tokens": ("num_accepted_tokens", "Draft tokens accepted."),
    "specdec:num_preemptions": ("num_preemptions", "Requests preempted (KV freed, recomputed later)."),
}
REJECT_REASONS = ("per_key_limit", "shutting_down")
_PER_POS = "specdec:spec_decode_num_accepted_tokens_per_pos"
_GAUGES = {
    "specdec:num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "specdec:num_requests_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "specdec:kv_cache_usage_perc": ("kv_cache_usage", "Fraction of KV-cache blocks in use (0..1)."),
}


class ServerMetrics:
    def __init__(self, num_speculative_tokens: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.ttft = Histogram("specdec:time_to_first_token_seconds", "Time to first output token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("specdec:inter_token_latency_seconds",
                             "Time between consecutive outputs of a request (one step may carry several "
                             "tokens).", buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("specdec:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=E2E_BUCKETS, registry=reg)
        self.gauges = {name: Gauge(name, doc, registry=reg) for name, (_, doc) in _GAUGES.items()}
        self.counters = {name: Counter(name, doc, registry=reg) for name, (_, doc) in _ENGINE_COUNTERS.items()}
        self.per_pos = Counter(_PER_POS, "Accepted draft tokens by draft position.", ["position"], registry=reg)
        for pos in range(num_speculative_tokens):
            self.per_pos.labels(position=str(pos))
        self.rejected = Counter("specdec:requests_rejected", "Requests refused before they ran: per_key_limit "
                                "(429), shutting_down (503).", ["reason"], registry=reg)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        ProcessCollector(registry=reg)  # process_resident_memory_bytes etc. (Linux /proc/self)
        self._last: dict[str, Any] = {}

    def refresh(self, stats: dict[str, Any]) -> None:
        """Move counters by the engine's deltas since the last refresh; set the gauges."""
        for name, (key, _) in _GAUGES.items():
            self.gauges[name].set(float(stats.get(key, 0.0)))
        for name, (key, _) in _ENGINE_COUNTERS.items():
            self.counters[name].inc(self._delta(key, stats.get(key, 0)))
        last_pos = self._last.get("num_accepted_tokens_per_pos") or []
        for pos, value in enumerate(stats.get("num_accepted_tokens_per_pos") or []):
            before = last_pos[pos] if pos < len(last_pos) else 0
            self.per_pos.labels(position=str(pos)).inc(max(0, value - before))
        self._last = dict(stats)

    def _delta(self, key: str, value: float) -> float:
        return max(0.0, float(value) - float(self._last.get(key, 0)))

    def render(self, stats: dict[str, Any]) -> bytes:
        self.refresh(stats)
        return generate_latest(self.registry)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Observes TTFT / inter-token / end-to-end latency from one request's outputs."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.num_tokens = 0
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        now = time.monotonic()
        if num_tokens > self.num_tokens:
            if self.last is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last, self.num_tokens = now, num_tokens
        if output.finished and not self.done and output.error is None:
            self.done = True
            self.metrics.e2e.observe(now - self.start)
