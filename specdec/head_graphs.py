"""Draft heads' forwards as CUDA graphs: a heads step reads a few rows (the target's last
hidden states, or a tree's frontier states) and runs a few small kernels over them, so on a
GPU it costs its launches, not its arithmetic. `HeadGraphs` captures such a function once
per row bucket (1, 2, 4, ... up to the most rows a step can ask for) and replays it.

A call of N rows pads its inputs to the smallest bucket of at least N rows, copies them
into the static buffers the graphs read, replays that bucket's graph and returns copies of
the first N rows of each output (the next replay overwrites the buffers). The function must
compute each row from that row alone (true of the heads: row-wise projections, embedding
lookups and the LM head), so the padding rows, which hold whatever an earlier call left,
change nothing but their own dropped results. Calls over more rows than the largest bucket
run the function eagerly.

Generic over the function (Medusa heads, a recurrent heads step): the drafters build it,
the engine core knows nothing of them. The padding and the buffers are host code, tested
on the CPU with `capture` replaced by an eager rerun; capture needs a GPU.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.cuda_graphs import record

HeadForward = Callable[..., tuple[torch.Tensor, ...]]  # row-major inputs -> row-major outputs


def row_buckets(max_rows: int) -> list[int]:
    """Powers of two below max_rows, then max_rows: at most twice the rows run."""
    buckets, size = [], 1
    while size < max_rows:
        buckets.append(size)
        size *= 2
    return [*buckets, max_rows]


@dataclass
class CapturedHeads:
    graph: Any  # torch.cuda.CUDAGraph (or a stand-in with `replay`)
    outputs: tuple[torch.Tensor, ...]  # the graph's output buffers, [bucket, ...] each


def capture(forward: Callable[[], tuple[torch.Tensor, ...]], pool: Any, device: torch.device) -> CapturedHeads:
    """`forward` captured (cuda_graphs.record); replaying the graph refills the returned buffers."""
    return CapturedHeads(*record(forward, pool, device))


class HeadGraphs:
    """`forward` replayed from graphs captured per row bucket up to `max_rows` rows.
    `examples`: one tensor per input, of one row ([1, ...]) with the input's dtype and
    device, from which the static buffers are made."""

    def __init__(self, forward: HeadForward, examples: Sequence[torch.Tensor], max_rows: int) -> None:
        self.forward = forward
        self.buckets = row_buckets(max_rows)
        self.buffers = [torch.zeros(max_rows, *e.shape[1:], dtype=e.dtype, device=e.device) for e in examples]
        self.device = examples[0].device
        self.captured: dict[int, CapturedHeads] = {}
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket, largest first, in one memory pool (one replays at a time)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self.captured[size] = capture(self._on_buffers(size), pool, self.device)

    def _on_buffers(self, size: int) -> Callable[[], tuple[torch.Tensor, ...]]:
        """`forward` over the first `size` rows of the static buffers."""
        views = [buffer[:size] for buffer in self.buffers]
        return lambda: self.forward(*views)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # each [N, ...]
        rows = int(inputs[0].shape[0])
        bucket = next((size for size in self.buckets if size >= rows), None)
        if bucket is None or rows == 0:
            return self.forward(*inputs)
        for buffer, values in zip(self.buffers, inputs, strict=True):
            buffer[:rows].copy_(values, non_blocking=True)
        step = self.captured[bucket]
        step.graph.replay()
        return tuple(output[:rows].clone() for output in step.outputs)
