"""Draft heads replayed from graphs per row bucket (specdec/head_graphs.py): the padding,
the static buffers and the copies out, with each graph replaced by an eager rerun of what it
captured (the CPU stand-in), against the heads run eagerly; a `cuda`-marked test captures
and replays for real. The engine-level runs are in tests/engine/test_cuda_default.py."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec import head_graphs
from specdec.head_graphs import CapturedHeads, HeadGraphs, row_buckets


class Rerun:
    """A graph's CPU stand-in: replaying runs the captured forward again, into the buffers
    the capture returned."""

    def __init__(self, forward: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        self.forward = forward
        self.outputs = forward()
        self.replays = 0

    @torch.inference_mode()  # as the capture ran (a real replay runs no torch op)
    def replay(self) -> None:
        self.replays += 1
        for buffer, value in zip(self.outputs, self.forward(), strict=True):
            buffer.copy_(value)


def capture_eagerly(forward: Callable[[], tuple[torch.Tensor, ...]], pool: object,
                    device: torch.device) -> CapturedHeads:
    graph = Rerun(forward)
    return CapturedHeads(graph, graph.outputs)


@pytest.fixture
def eager_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_graphs, "capture", capture_eagerly)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_row_buckets() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(4) == [1, 2, 4]
    assert row_buckets(10) == [1, 2, 4, 8, 10]
    assert row_buckets(640) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 640]


def rowwise(weight: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A heads-like step: states [N, H] and token ids [N] -> new states and their logits."""
    embedding = torch.randn(20, weight.shape[1], generator=torch.Generator().manual_seed(1))

    def step(states: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = torch.tanh(states + embedding[ids])
        return new, new @ weight.T

    return step


def test_calls_pad_to_their_bucket_and_equal_eager_runs(eager_graphs: None) -> None:
    weight = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    step = rowwise(weight)
    graphs = HeadGraphs(step, [torch.zeros(1, 5), torch.zeros(1, dtype=torch.long)], max_rows=6)
    assert sorted(graphs.captured) == [1, 2, 4, 6]
    gen = torch.Generator().manual_seed(2)
    kept = []
    for rows in (3, 1, 6, 2, 5, 9):  # 9: over the largest bucket, run eagerly
        states, ids = torch.randn(rows, 5, generator=gen), torch.randint(0, 20, (rows,), generator=gen)
        got = graphs(states, ids)
        want = step(states, ids)
        assert [g.shape for g in got] == [w.shape for w in want]
        assert all(torch.allclose(g, w) for g, w in zip(got, want))
        kept.append((got, want))
    # Outputs are copies: later replays (over the same buffers) left earlier results alone.
    assert all(torch.allclose(g, w) for got, want in kept for g, w in zip(got, want))
    replays = {size: step.graph.replays for size, step in graphs.captured.items()}
    assert replays == {1: 1, 2: 1, 4: 1, 6: 2}


@pytest.mark.cuda
def test_head_graphs_capture_and_replay_on_a_gpu() -> None:
    device = torch.device("cuda")
    weight = torch.randn(7, 5, device=device)
    embedding = torch.randn(20, 5, device=device)

    def step(states: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = torch.tanh(states + embedding[ids])
        return new, new @ weight.T

    graphs = HeadGraphs(step, [torch.zeros(1, 5, device=device), torch.zeros(1, dtype=torch.long, device=device)],
                        max_rows=8)
    assert all(isinstance(c.graph, torch.cuda.CUDAGraph) for c in graphs.captured.values())
    for rows in (1, 3, 8, 12):
        states, ids = torch.randn(rows, 5, device=device), torch.randint(0, 20, (rows,), device=device)
        for got, want in zip(graphs(states, ids), step(states, ids)):
            torch.testing.assert_close(got, want)
