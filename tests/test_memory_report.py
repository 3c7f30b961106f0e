"""The start-up memory line (specdec/memory_report.py): RSS now, and RSS once the KV pool's
pages not yet written become resident; and, seen from outside (evals/load_test.py), when
the pool has been written once and the RSS from then on."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from specdec.kernels.kv_cache import PagedKV
from specdec.memory_report import (
    MIB,
    MemoryReport,
    format_size,
    kv_filled_at,
    memory_report,
    process_rss,
    resident_bytes,
    rss_once_filled,
)
from specdec.model_runner import KVCache
from specdec.server.stats_log import kv_pool_tokens

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and mincore(2)")


def test_the_untouched_part_of_the_pool_is_added_to_the_rss() -> None:
    idle = MemoryReport(rss=527 * MIB, kv_bytes=1024 * MIB, kv_resident=0)
    assert idle.expected_rss == 1551 * MIB
    assert idle.describe() == "RSS 527 MiB now; about 1.51 GiB once the 1.00 GiB KV cache is in use"
    warm = MemoryReport(rss=600 * MIB, kv_bytes=1024 * MIB, kv_resident=100 * MIB)
    assert warm.expected_rss == 1524 * MIB  # what is resident already is in the RSS
    assert MemoryReport(rss=1600 * MIB, kv_bytes=1024 * MIB, kv_resident=1024 * MIB).expected_rss == 1600 * MIB


def test_a_pool_in_gpu_memory_adds_nothing() -> None:
    report = MemoryReport(rss=900 * MIB, kv_bytes=0, kv_resident=0)
    assert report.expected_rss == 900 * MIB
    assert report.describe() == "RSS 900 MiB (the KV cache is not in host memory)"


def test_sizes_are_whole_mib_below_a_gib_and_gib_from_there() -> None:
    assert format_size(0) == "0 MiB"
    assert format_size(1023 * MIB) == "1023 MiB"
    assert format_size(1024 * MIB) == "1.00 GiB"
    assert format_size(1587 * MIB) == "1.55 GiB"


@linux_only
def test_the_pool_is_read_from_the_engines_kv_tensors() -> None:
    # 16 slots x 2 heads x 64 float32 = 8 KiB per block and layer: whole pages
    layers = [PagedKV.zeros(64, 16, 2, 64, torch.float32) for _ in range(3)]
    engine = SimpleNamespace(runner=SimpleNamespace(kv_cache=SimpleNamespace(layers=layers)))
    per_block = KVCache.bytes_per_block(3, 16, 2, 64, torch.float32)
    before = memory_report(engine)
    assert before is not None and before.kv_bytes == 64 * per_block and before.kv_resident == 0
    for layer in layers:  # three blocks written, in every layer
        layer.k[:3] = 1.0
        layer.v[:3] = 1.0
    after = memory_report(engine)
    assert after is not None and after.kv_resident == 3 * per_block
    assert after.expected_rss - after.rss == 61 * per_block


@linux_only
def test_resident_bytes_count_written_pages_only() -> None:
    pool = PagedKV.zeros(32, 16, 2, 64, torch.float32).k  # 256 KiB, untouched
    assert resident_bytes(pool.data_ptr(), pool.nbytes) == 0
    pool[5] = 2.0
    assert resident_bytes(pool.data_ptr(), pool.nbytes) == pool[5].nbytes
    rss = process_rss()
    assert rss is not None and rss > pool.nbytes


def test_the_pool_counts_as_filled_when_finished_requests_tokens_reach_its_size() -> None:
    finished = [(3.0, 400), (1.0, 500), (2.0, 200)]  # (end time, prompt + completion tokens), any order
    assert kv_filled_at(finished, 700) == 2.0
    assert kv_filled_at(finished, 1100) == 3.0
    assert kv_filled_at(finished, 1101) is None
    samples = [(0.5, 500.0), (1.5, 900.0), (2.5, 1500.0), (3.5, 1490.0), (9.0, None)]  # (s, MiB); None: unread
    assert rss_once_filled(samples, finished, 700) == (2.0, 1500.0)
    assert rss_once_filled(samples, finished, 1101) == (None, None)
    assert rss_once_filled(samples, finished, None) == (None, None)  # a server whose pool size is unknown


def test_the_pool_size_is_read_back_from_the_startup_line() -> None:
    log = ("INFO warm-up: 3 engine steps in 0.10 s\nINFO ready: model tiny (/m), dtype float32, device cpu, KV cache "
           "2845 blocks = 45520 tokens (float16), max_model_len 2048; RSS 527 MiB now; about 1.51 GiB once ...\n")
    assert kv_pool_tokens(log) == 45520
    assert kv_pool_tokens("INFO nothing of the kind") is None
