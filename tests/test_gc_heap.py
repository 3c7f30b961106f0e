"""Tests for specdec.gc_heap: start-up garbage is collected, live objects leave the generations."""
from __future__ import annotations

import gc
import weakref

from specdec.gc_heap import freeze_startup_heap


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
