"""Keep Python's full garbage collections short in a long-lived engine process.

Once the model, tokenizer and chat template are loaded the process holds a few hundred
thousand Python objects (222k for the default model), and a full (oldest-generation)
collection walks every one: ~200 ms on a 2-core machine, stalling whichever step
triggered it (one in 13 s of decoding, measured). `gc.freeze()` moves the objects that
exist into a permanent generation that collections skip, as vLLM's engine core does after
start-up. Frozen objects are still freed by reference counting; only a garbage cycle
among them is never collected, so freeze only where they live as long as the process:
a server after its warm-up, not a library call that may build and drop engines.

An engine built through the Python API is not frozen, but it starts with one full
collection (`collect_startup_garbage`): loading leaves the oldest generation's
pending count far above its threshold, and the first full collection (~100 ms) would
otherwise stall one of the first requests' steps.
"""
from __future__ import annotations

import gc


def collect_startup_garbage() -> None:
    """One full collection now, so that the next is not due until the heap grows by a
    quarter (CPython runs a full collection only once objects promoted since the last
    one reach 25% of those it kept)."""
    gc.collect()


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then exempt every live object from later
    collections; returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
