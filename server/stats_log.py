"""What the server logs about its engine: the start-up summary (with its memory now and
once the KV cache is in use, specdec/memory_report.py), and a periodic stats line like
vLLM's (throughput, queue, KV cache, prefix cache, draft acceptance).

The stats line reads only the snapshot the engine thread publishes (AsyncEngine.stats),
never the engine itself, and runs as an asyncio task in the app's lifespan.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from specdec.memory_report import memory_report
from specdec.metrics import EngineMetrics

logger = logging.getLogger(__name__)
# Counters whose movement since the last line means the engine was busy.
_ACTIVITY = ("num_prompt_tokens", "num_generation_tokens", "num_steps")


def startup_summary(engine: Any, served_model_name: str) -> str:
    """One line of the settings that decide the engine's speed and capacity, and its memory."""
    config, bm = engine.config, engine.block_manager
    model = engine.model
    memory = memory_report(engine)
    return (f"ready: model {served_model_name} ({engine.model_dir}), dtype {_dtype_name(config.dtype)}, "
            f"device {engine.device}, attention backend {model.attention_backend.name}, linear backend "
            f"{model.linear_backend.name}, KV cache {bm.num_blocks} blocks = {bm.num_blocks * bm.block_size} "
            f"tokens ({_dtype_name(config.kv_cache_torch_dtype)}), max_model_len {engine.max_model_len}, "
            f"max_num_seqs {config.max_num_seqs}, prefix caching {'on' if config.enable_prefix_caching else 'off'}, "
            f"speculation {speculation_summary(config.speculative_config)}"
            + ("" if memory is None else f"; {memory.describe()}"))


def kv_pool_tokens(log: str) -> int | None:
    """The KV pool's size in tokens, read back from a log holding `startup_summary`'s line."""
    match = re.search(r"KV cache \d+ blocks = (\d+) tokens", log)
    return int(match.group(1)) if match else None


def speculation_summary(spec: Any) -> str:
    """A speculative config as `ngram k=3 tree nodes=0 adaptive=off`, or "off"."""
    if spec is None:
        return "off"
    return (f"{spec.method} k={spec.num_speculative_tokens} tree nodes={spec.num_tree_nodes} "
            f"adaptive={'on' if spec.adaptive else 'off'}")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class StatsLogger:
    """Every `interval` seconds, one line about the interval just past, unless the engine
    was idle all of it (no tokens processed, no request running or waiting)."""

    def __init__(self, read_stats: Callable[[], Mapping[str, Any]], interval: float, speculative: bool) -> None:
        if not interval > 0:
            raise ValueError(f"the stats interval must be positive, got {interval}")
        self.read_stats, self.interval, self.speculative = read_stats, interval, speculative
        self.last: Mapping[str, Any] = dict(read_stats())
        self.last_time = time.monotonic()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            line = self.line(time.monotonic())
            if line is not None:
                logger.info("%s", line)

    def line(self, now: float) -> str | None:
        """The line for the time since the previous call, or None when idle."""
        stats, last = dict(self.read_stats()), self.last
        elapsed = max(now - self.last_time, 1e-9)
        self.last, self.last_time = stats, now
        running, waiting = int(stats.get("num_requests_running", 0)), int(stats.get("num_requests_waiting", 0))
        if not running and not waiting and all(_delta(stats, last, key) == 0 for key in _ACTIVITY):
            return None
        parts = [f"Avg prompt throughput: {_delta(stats, last, 'num_prompt_tokens') / elapsed:.1f} tokens/s",
                 f"Avg generation throughput: {_delta(stats, last, 'num_generation_tokens') / elapsed:.1f} tokens/s",
                 f"Running: {running} reqs", f"Waiting: {waiting} reqs",
                 f"KV cache usage: {100 * float(stats.get('kv_cache_usage', 0.0)):.1f}%",
                 f"Prefix cache hit rate: {100 * prefix_cache_hit_rate(stats):.1f}%"]
        if self.speculative:
            parts += _speculation_parts(stats, last)
        return ", ".join(parts)


def prefix_cache_hit_rate(stats: Mapping[str, Any]) -> float:
    """Prompt tokens found in the prefix cache over prompt tokens looked up, since start."""
    queries = float(stats.get("prefix_cache_queries", 0))
    return float(stats.get("prefix_cache_hits", 0)) / queries if queries else 0.0


def _speculation_parts(stats: Mapping[str, Any], last: Mapping[str, Any]) -> list[str]:
    """Acceptance over the interval, as EngineMetrics defines it (accepted / drafted
    tokens, and τ: tokens committed per verify step)."""
    interval = EngineMetrics.from_dict(stats) - EngineMetrics.from_dict(last)
    if not interval.num_drafts:
        return ["Draft acceptance rate: n/a (no drafts)"]
    return [f"Draft acceptance rate: {100 * interval.acceptance_rate:.1f}%",
            f"Mean accepted length: {interval.mean_accepted_length:.2f}"]


def _delta(stats: Mapping[str, Any], last: Mapping[str, Any], key: str) -> float:
    return float(stats.get(key, 0)) - float(last.get(key, 0))
