"""How long each step's drafting and forward took, for policies that learn costs.

The engine marks three points of a step (`start`, `drafted`, `finish`) and hands the step's
report to `finish`; it gets back the reports of finished steps whose times are known, for
the policy's `observe_step`.

- `HostTimer`: the host's clock. On the CPU a forward returns when it is computed, so the
  host's clock times it.
- `CudaEventTimer`: CUDA events recorded on the stream at the three points. A kernel launch
  returns before the GPU runs it, so the host's clock would time the launches; the events
  time the GPU's timeline instead (host work the GPU waits for included, work overlapped
  with the host's excluded). Their times are read one step late, when `Event.query` says
  the step's last event has passed: no step waits for the GPU to be timed.

`measure_seconds` times a call once with a sync, for start-up calibration.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from specdec.spec.policy import StepReport

# Reports of steps whose events have not passed yet, at most: a stream that stalls cannot
# grow the queue without bound (the oldest are dropped unreported).
MAX_PENDING = 16


class StepTimer(Protocol):
    def start(self) -> None:
        """The step begins: drafting comes next."""

    def drafted(self) -> None:
        """Drafting is done: the forward is queued next."""

    def finish(self, report: StepReport) -> list[StepReport]:
        """The forward is queued (or, on the CPU, done). `report`: the step's sizes (its
        times are replaced). Returns the finished steps whose times are now known, oldest first."""
        ...


class HostTimer:
    """Times steps on a host clock (`clock`: seconds); each step's report comes back at once."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._start = self._drafted = clock()

    def start(self) -> None:
        self._start = self.clock()

    def drafted(self) -> None:
        self._drafted = self.clock()

    def finish(self, report: StepReport) -> list[StepReport]:
        end = self.clock()
        return [replace(report, draft_seconds=self._drafted - self._start, forward_seconds=end - self._drafted)]


class Event(Protocol):
    """What the timer uses of torch.cuda.Event."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Event) -> float: ...  # milliseconds


def timing_event() -> Event:
    event: Event = torch.cuda.Event(enable_timing=True)  # type: ignore[assignment]
    return event


@dataclass
class _Pending:
    report: StepReport
    start: Event
    drafted: Event
    end: Event


class CudaEventTimer:
    """Times steps with events on the current CUDA stream (`new_event`: an event factory, a
    fake one in tests), reporting each step once its last event has passed."""

    def __init__(self, new_event: Callable[[], Event] = timing_event) -> None:
        self.new_event = new_event
        self._spare: list[Event] = []  # events of reported steps, reused
        self._marks: list[Event] = []  # this step's start and drafted events
        self._pending: deque[_Pending] = deque()

    def start(self) -> None:
        self._marks = [self._record()]

    def drafted(self) -> None:
        self._marks.append(self._record())

    def finish(self, report: StepReport) -> list[StepReport]:
        done = self._collect()  # the earlier steps: this one's forward is still queued
        if len(self._marks) == 2:
            start, drafted = self._marks
            self._pending.append(_Pending(report, start, drafted, self._record()))
            if len(self._pending) > MAX_PENDING:
                self._pending.popleft()
        self._marks = []
        return done

    def _record(self) -> Event:
        event = self._spare.pop() if self._spare else self.new_event()
        event.record()
        return event

    def _collect(self) -> list[StepReport]:
        """The reports of the pending steps whose end event has passed, oldest first (the
        stream runs them in order, so the first one still running ends the search)."""
        done = []
        while self._pending and self._pending[0].end.query():
            step = self._pending.popleft()
            draft_ms, forward_ms = step.start.elapsed_time(step.drafted), step.drafted.elapsed_time(step.end)
            done.append(replace(step.report, draft_seconds=draft_ms / 1000, forward_seconds=forward_ms / 1000))
            self._spare += [step.start, step.drafted, step.end]
        return done


def step_timer(device: torch.device) -> StepTimer:
    """The timer for steps on `device`: CUDA events on a GPU, else the host's clock."""
    return CudaEventTimer() if device.type == "cuda" else HostTimer()


def measure_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn` takes on `device`: on CUDA from events around it, waiting for them
    (start-up only), else on the host's clock."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = timing_event(), timing_event()
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1000
