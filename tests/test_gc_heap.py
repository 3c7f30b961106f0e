"""Tests for specdec.gc_heap: start-up garbage is collected, live objects leave the generations,
and an engine built through the Python API starts after a full collection."""
from __future__ import annotations

import gc
import weakref
from pathlib import Path

from specdec.gc_heap import freeze_startup_heap
from specdec.llm import LLM


class _Node:
    other: object = None


def test_freeze_collects_start_up_garbage_then_exempts_what_lives() -> None:
    garbage = _Node()
    garbage.other = garbage  # a cycle: only a collection frees it
    dead = weakref.ref(garbage)
    del garbage
    live = [_Node()]
    try:
        frozen = freeze_startup_heap()
        assert dead() is None
        assert frozen > 0  # (other threads of the test process may free frozen objects since)
        assert not any(o is live for o in gc.get_objects())  # no generation walks it any more
    finally:
        gc.unfreeze()
    assert any(o is live for o in gc.get_objects())


def test_an_engine_built_through_the_python_api_starts_after_a_full_collection(tiny_model_dir: Path) -> None:
    garbage = _Node()
    garbage.other = garbage
    gc.collect()  # the cycle is now in the oldest generation: only a full collection frees it
    dead = weakref.ref(garbage)
    del garbage
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection may free it while the engine is built
    try:
        LLM(str(tiny_model_dir), max_model_len=64, kv_cache_memory=1 << 20)
        assert dead() is None
    finally:
        if was_enabled:
            gc.enable()
