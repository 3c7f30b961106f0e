"""Prometheus metrics of one server, on a registry of its own: `specdec:*` metrics and their
`vllm:*` twins, so dashboards and schedulers made for vLLM read this server unchanged.

Latency histograms are observed as outputs reach the event loop. Engine counters are
advanced from the deltas of the engine's cumulative `get_metrics()` snapshot, and the
gauges are set from it, at scrape time. prometheus_client exposes a counter `x` as the
sample `x_total` (its HELP/TYPE lines keep the bare name `x`). The standard `process_*`
metrics (resident memory, CPU time, open fds) come along, so load tests can watch the
server's memory from outside.

The vLLM twins (vLLM v1 names, each labelled `model_name` = the served model name) move
with the same data as the specdec metric beside them:

    vllm:num_requests_running, vllm:num_requests_waiting     specdec:num_requests_running/_waiting
    vllm:kv_cache_usage_perc (0..1)                           specdec:kv_cache_usage_perc
    vllm:prompt_tokens_total, vllm:generation_tokens_total    specdec:prompt_tokens_total, ...
    vllm:num_preemptions_total                                specdec:num_preemptions_total
    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total   specdec:prefix_cache_queries/hits_total
    vllm:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total,
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}   the specdec:spec_decode_* counters
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:e2e_request_latency_seconds                          the specdec:* histograms (vLLM's buckets)

and, with no specdec twin, observed per completion when its request finishes (a request
with n completions counts n, as vLLM's child requests do):

    vllm:request_success_total{finished_reason}   stop | length | abort (failed requests are not counted)
    vllm:request_prompt_tokens, vllm:request_generation_tokens   histograms, 1-2-5 buckets up to max_model_len
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
# vLLM v1's buckets for the twins
VLLM_TTFT_BUCKETS = (*TTFT_BUCKETS, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
VLLM_FINISH_REASONS = ("stop", "length", "abort")
MODEL_LABEL = "model_name"

# key of the engine's get_metrics() -> (specdec counter, vLLM counter, help)
_ENGINE_COUNTERS = {
    "num_prompt_tokens": ("specdec:prompt_tokens_total", "vllm:prompt_tokens", "Prompt tokens processed."),
    "num_generation_tokens": ("specdec:generation_tokens_total", "vllm:generation_tokens",
                              "Generated (committed) tokens."),
    "num_drafts": ("specdec:spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
                   "Verify steps that carried draft tokens."),
    "num_draft_tokens": ("specdec:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens",
                         "Draft tokens proposed."),
    "num_accepted_tokens": ("specdec:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
                            "Draft tokens accepted."),
    "num_preemptions": ("specdec:num_preemptions", "vllm:num_preemptions",
                        "Requests preempted (KV freed, recomputed later)."),
    "prefix_cache_queries": ("specdec:prefix_cache_queries", "vllm:prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("specdec:prefix_cache_hits", "vllm:prefix_cache_hits",
                          "Prompt tokens found in the prefix cache."),
}
REJECT_REASONS = ("per_key_limit", "shutting_down")
_PER_POS = ("specdec:spec_decode_num_accepted_tokens_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos")
# key of the engine's get_metrics() -> (specdec gauge, vLLM gauge, help)
_GAUGES = {
    "num_requests_running": ("specdec:num_requests_running", "vllm:num_requests_running",
                             "Requests in the running batch."),
    "num_requests_waiting": ("specdec:num_requests_waiting", "vllm:num_requests_waiting",
                             "Requests waiting to be scheduled."),
    "kv_cache_usage": ("specdec:kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
                       "Fraction of KV-cache blocks in use (0..1)."),
}


class TwinHistogram:
    """A specdec histogram and its vLLM twin (its own buckets, the model label): one observation, both."""

    def __init__(self, ours: Histogram, theirs: Histogram) -> None:
        self.ours, self.theirs = ours, theirs

    def observe(self, value: float) -> None:
        self.ours.observe(value)
        self.theirs.observe(value)


class ServerMetrics:
    def __init__(self, num_speculative_tokens: int, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.ttft = self._histograms("time_to_first_token_seconds", "Time to first output token.", TTFT_BUCKETS,
                                     VLLM_TTFT_BUCKETS)
        self.itl = self._histograms("inter_token_latency_seconds", "Time between consecutive outputs of a request "
                                    "(one step may carry several tokens).", ITL_BUCKETS, VLLM_ITL_BUCKETS)
        self.e2e = self._histograms("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS,
                                    VLLM_E2E_BUCKETS)
        self.gauges = {key: self._pair(Gauge, names) for key, names in _GAUGES.items()}
        self.counters = {key: self._pair(Counter, names) for key, names in _ENGINE_COUNTERS.items()}
        self._add_per_pos(num_speculative_tokens)
        self._add_request_metrics(max_model_len)
        self.rejected = Counter("specdec:requests_rejected", "Requests refused before they ran: per_key_limit "
                                "(429), shutting_down (503).", ["reason"], registry=self.registry)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. (Linux /proc/self)
        self._last: dict[str, Any] = {}

    def _histograms(self, name: str, doc: str, buckets: tuple[float, ...],
                    vllm_buckets: tuple[float, ...]) -> TwinHistogram:
        ours = Histogram(f"specdec:{name}", doc, buckets=buckets, registry=self.registry)
        theirs = Histogram(f"vllm:{name}", doc, [MODEL_LABEL], buckets=vllm_buckets, registry=self.registry)
        return TwinHistogram(ours, theirs.labels(self.model_name))

    def _pair(self, kind: type[Gauge] | type[Counter], names: tuple[str, str, str]) -> tuple[Any, Any]:
        ours, theirs, doc = names
        return kind(ours, doc, registry=self.registry), kind(theirs, doc, [MODEL_LABEL],
                                                              registry=self.registry).labels(self.model_name)

    def _add_per_pos(self, num_speculative_tokens: int) -> None:
        doc = "Accepted draft tokens by draft position."
        self.per_pos = Counter(_PER_POS[0], doc, ["position"], registry=self.registry)
        self.vllm_per_pos = Counter(_PER_POS[1], doc, [MODEL_LABEL, "position"], registry=self.registry)
        for pos in range(num_speculative_tokens):
            self.per_pos.labels(position=str(pos))
            self.vllm_per_pos.labels(self.model_name, str(pos))

    def _add_request_metrics(self, max_model_len: int) -> None:
        reg, buckets = self.registry, token_buckets(max_model_len)
        self.request_success = Counter("vllm:request_success", "Finished requests (each completion of n), by "
                                       "finish reason.", [MODEL_LABEL, "finished_reason"], registry=reg)
        for reason in VLLM_FINISH_REASONS:
            self.request_success.labels(self.model_name, reason)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished "
                                               "request.", [MODEL_LABEL], buckets=buckets,
                                               registry=reg).labels(self.model_name)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens of each "
                                                   "finished request.", [MODEL_LABEL], buckets=buckets,
                                                   registry=reg).labels(self.model_name)

    def refresh(self, stats: dict[str, Any]) -> None:
        """Move counters by the engine's deltas since the last refresh; set the gauges."""
        for key, gauges in self.gauges.items():
            for gauge in gauges:
                gauge.set(float(stats.get(key, 0.0)))
        for key, counters in self.counters.items():
            delta = self._delta(key, stats.get(key, 0))
            for counter in counters:
                counter.inc(delta)
        last_pos = self._last.get("num_accepted_tokens_per_pos") or []
        for pos, value in enumerate(stats.get("num_accepted_tokens_per_pos") or []):
            delta = max(0, value - (last_pos[pos] if pos < len(last_pos) else 0))
            self.per_pos.labels(position=str(pos)).inc(delta)
            self.vllm_per_pos.labels(self.model_name, str(pos)).inc(delta)
        self._last = dict(stats)

    def _delta(self, key: str, value: float) -> float:
        return max(0.0, float(value) - float(self._last.get(key, 0)))

    def render(self, stats: dict[str, Any]) -> bytes:
        self.refresh(stats)
        return generate_latest(self.registry)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def finish(self, output: RequestOutput, latency: float) -> None:
        """A request's final output: its end-to-end latency, and per completion its finish
        reason and token counts (a failed request counts for neither)."""
        if output.error is not None:
            return
        self.e2e.observe(latency)
        for completion in output.outputs:
            if completion.finish_reason in VLLM_FINISH_REASONS:
                self.request_success.labels(self.model_name, completion.finish_reason).inc()
            self.request_prompt_tokens.observe(len(output.prompt_token_ids))
            self.request_generation_tokens.observe(len(completion.token_ids))

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


def token_buckets(max_value: int) -> list[int]:
    """vLLM's 1-2-5 buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


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
        if output.finished and not self.done:
            self.done = True
            self.metrics.finish(output, now - self.start)
