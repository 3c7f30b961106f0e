"""Step timing behind one interface (specdec/spec/step_timer.py): the host clock's timer and
the CUDA-event timer, the latter on fake events whose timeline the test sets, read one step
late and never before the GPU passed a step's last event. The adaptive policy is driven
through either timer by a fake clock: its grants follow the fake step costs."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specdec.spec import adaptive
from specdec.spec.adaptive import CALIBRATION_SIZES, PROBE_EVERY, AdaptiveSpeculation, CostModel, calibrate
from specdec.spec.policy import DraftLimit, StepReport
from specdec.spec.step_timer import CudaEventTimer, HostTimer, StepTimer, measure_seconds, step_timer


class FakeGpu:
    """A GPU timeline: `now` is when the next queued work starts (seconds), `passed` how far
    the GPU has run (events recorded later have not passed)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.passed = 0.0

    def run(self, seconds: float) -> None:
        self.now += seconds

    def sync(self) -> None:
        self.passed = self.now


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.at = -1.0
        self.recorded = 0

    def record(self) -> None:
        self.at = self.gpu.now
        self.recorded += 1

    def query(self) -> bool:
        return self.at <= self.gpu.passed

    def elapsed_time(self, end_event: Any) -> float:
        return float((end_event.at - self.at) * 1000)


def sizes(tokens: int = 3, depth: int = 2) -> StepReport:
    """A decode step's report before its times are known (they are replaced)."""
    return StepReport(num_query_tokens=tokens, decode_only=True, max_draft_depth=depth, draft_seconds=-1.0,
                      forward_seconds=-1.0)


def test_host_timer_reports_each_step_at_once() -> None:
    clock = iter([0.0, 1.0, 1.25, 2.0])
    timer = HostTimer(lambda: next(clock))
    timer.start()
    timer.drafted()
    [report] = timer.finish(sizes())
    assert (report.draft_seconds, report.forward_seconds) == (0.25, 0.75)
    assert report.num_query_tokens == 3 and report.max_draft_depth == 2


def test_cuda_event_timer_reads_a_step_once_its_last_event_passed() -> None:
    gpu = FakeGpu()
    events: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        events.append(FakeEvent(gpu))
        return events[-1]

    timer = CudaEventTimer(new_event)
    timer.start()
    gpu.run(0.002)  # drafting
    timer.drafted()
    gpu.run(0.010)  # the forward, queued: not run yet
    assert timer.finish(sizes(5)) == []  # its own events are never read in its step
    timer.start()
    timer.drafted()
    assert timer.finish(sizes(1)) == []  # the first step's forward has not passed yet: no wait
    gpu.sync()
    timer.start()
    gpu.run(0.001)
    timer.drafted()
    gpu.run(0.004)
    first, second = timer.finish(sizes(2))  # both earlier steps, oldest first
    assert first.num_query_tokens == 5
    assert first.draft_seconds == pytest.approx(0.002) and first.forward_seconds == pytest.approx(0.010)
    assert second.num_query_tokens == 1 and second.forward_seconds == pytest.approx(0.0)
    gpu.sync()
    timer.start()
    timer.drafted()
    [third] = timer.finish(sizes(1))
    assert third.draft_seconds == pytest.approx(0.001) and third.forward_seconds == pytest.approx(0.004)
    assert len(events) == 8  # from the third step's end on, reported steps' events are recorded again


def test_a_step_that_failed_before_its_forward_is_not_reported() -> None:
    gpu = FakeGpu()
    timer = CudaEventTimer(lambda: FakeEvent(gpu))
    timer.start()  # drafting failed for every request: no drafted(), no finish()
    timer.start()
    timer.drafted()
    gpu.run(0.003)
    assert timer.finish(sizes()) == []
    gpu.sync()
    timer.start()
    timer.drafted()
    [report] = timer.finish(sizes())
    assert report.forward_seconds == pytest.approx(0.003)


def test_the_timer_follows_the_device() -> None:
    assert isinstance(step_timer(torch.device("cpu")), HostTimer)
    assert isinstance(step_timer(torch.device("cuda")), CudaEventTimer)  # events are made on first use
    assert measure_seconds(lambda: sum(range(1000)), torch.device("cpu")) > 0


# ---- the policy driven through a timer ---------------------------------------------------------


def limit(request_id: str, depth: int) -> DraftLimit:
    request: Any = SimpleNamespace(request_id=request_id)
    return DraftLimit(request, depth, depth)


class Rig:
    """One request decoding through `timer` on a fake clock: each step the policy grants,
    drafting costs nothing, the forward costs `cost(rows)` seconds, and every draft token
    is accepted (so drafting pays exactly when rows cost less than a step)."""

    def __init__(self, make_timer: str) -> None:
        self.gpu = FakeGpu()
        self.timer: StepTimer = (HostTimer(lambda: self.gpu.now) if make_timer == "host"
                                 else CudaEventTimer(lambda: FakeEvent(self.gpu)))
        self.policy = AdaptiveSpeculation(CostModel([1, 2, 4, 8], [0.01, 0.02, 0.04, 0.08]), whole_drafts=False)
        self.steps = 0

    def step(self, cost: Any) -> int:
        """One step; the draft tokens granted."""
        depth = 1 + self.steps % 4  # the room left varies, so the fitted line sees several row counts
        self.steps += 1
        [granted] = self.policy.grant([limit("r", depth)], 1, 1)
        self.timer.start()
        self.timer.drafted()
        self.gpu.run(cost(1 + granted))
        for report in self.timer.finish(sizes(1 + granted, granted)):
            self.policy.observe_step(report)
        self.gpu.sync()  # the verify reads the tokens back
        if granted:
            self.policy.observe_verify("r", granted, granted, granted)
        return granted

    def grants(self, cost: Any, steps: int) -> list[int]:
        return [self.step(cost) for _ in range(steps)]


def cheap_rows(rows: int) -> float:
    return 0.010 + 0.0001 * rows  # a GPU verify: rows nearly free


def dear_rows(rows: int) -> float:
    return 0.010 * rows  # each row as dear as a whole step


@pytest.mark.parametrize("timer", ["host", "cuda_events"])
def test_the_policys_grants_follow_the_timed_costs(timer: str) -> None:
    rig = Rig(timer)
    rig.grants(dear_rows, 40)  # the calibration's line: rows as dear as steps
    assert only_probes(rig.grants(dear_rows, 40))
    rig.grants(cheap_rows, 200)  # the probes' steps teach the line that rows got cheap
    assert all(rig.grants(cheap_rows, 20))
    # Back to dear rows: the cheap steps' points weigh more (relative error), so unlearning
    # them takes longer than learning them.
    rig.grants(dear_rows, 300)
    assert only_probes(rig.grants(dear_rows, 40))


def only_probes(grants: list[int]) -> bool:
    """Nothing but a one-token probe every PROBE_EVERY steps."""
    return max(grants) <= 1 and sum(grants) <= len(grants) // PROBE_EVERY + 1


# ---- the start-up verify-cost table ------------------------------------------------------------------------


class RecordingExecutor:
    """Records the steps calibrate runs."""

    def __init__(self) -> None:
        self.steps: list[Any] = []

    def run(self, inputs: Any, kv_caches: Any, device: torch.device) -> None:
        self.steps.append(inputs)


def test_calibration_runs_the_steps_the_engine_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, T rows as requests of at most 1 + the lookahead (the captured graphs'
    shapes), each after its own context in blocks of its own; on the CPU one request."""
    monkeypatch.setattr(adaptive, "measure_seconds", lambda fn, device: measure_seconds(fn, torch.device("cpu")))
    executor = RecordingExecutor()
    kv: Any = [SimpleNamespace(k=SimpleNamespace(device=torch.device("cuda"), shape=(100,)))]  # nothing runs there
    cost = calibrate(executor, kv, block_size=16, max_query_len=17, repeats=1)  # type: ignore[arg-type]
    assert cost.sizes == list(CALIBRATION_SIZES) and all(s > 0 for s in cost.seconds)
    by_size = {sum(step.query_lens): step for step in executor.steps}
    assert by_size[16].query_lens == [16] and by_size[64].query_lens == [17, 17, 17, 13]
    step = by_size[64]
    assert step.seq_lens == [64 + q for q in step.query_lens] and step.logit_rows == list(range(64))
    blocks = [b for table in step.block_tables for b in table]
    assert len(blocks) == len(set(blocks))  # no two requests share a block
    for b, table in enumerate(step.block_tables):
        rows = slice(sum(step.query_lens[:b]), sum(step.query_lens[: b + 1]))
        assert [s // 16 for s in step.slots[rows]] == [table[p // 16] for p in step.positions[rows]]
    for device, max_query_len in (("cuda", None), ("cpu", 17)):  # one request of every size
        single = RecordingExecutor()
        kv[0] = SimpleNamespace(k=SimpleNamespace(device=torch.device(device), shape=(100,)))
        calibrate(single, kv, block_size=16, max_query_len=max_query_len, repeats=1)  # type: ignore[arg-type]
        assert [s.query_lens for s in single.steps] == [[size] for size in CALIBRATION_SIZES]
    small = RecordingExecutor()  # a pool of 10 blocks: the requests' blocks wrap around it
    kv[0] = SimpleNamespace(k=SimpleNamespace(device=torch.device("cuda"), shape=(10,)))
    calibrate(small, kv, block_size=16, max_query_len=17, repeats=1)  # type: ignore[arg-type]
    assert all(0 <= b < 10 for step in small.steps for table in step.block_tables for b in table)
    assert all(0 <= slot < 160 for step in small.steps for slot in step.slots)
