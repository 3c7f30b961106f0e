"""The attention backend interface: one object per engine, chosen once by name
(kernels/attention.py), then called per step and per layer without any dispatch."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata


@dataclass
class AttentionPlan:
    """What a backend derives from one step's metadata, once, for every layer of the step."""

    meta: AttentionMetadata


PlanT = TypeVar("PlanT", bound=AttentionPlan)


class AttentionBackend(ABC, Generic[PlanT]):
    """Paged attention over a flattened batch, and the K/V store that precedes it.

    Contract:
    - `plan(meta, kv)` runs once per step, before the first layer. `kv` is any layer's
      cache of the step: every layer shares its block size, kv heads, head dim, dtype and
      device, which is all the plan may read from it (not its contents). The plan holds
      the index tensors the kernels derive from the batch layout and reuse in every layer.
      It does not change `meta`.
    - `store_kv(key, value, kv, plan)` writes the step's K and V ([T, Hkv, D], rows
      possibly strided views of a fused projection) into `kv` at `plan.meta.slot_mapping`;
      fp8 caches also get their per-slot scales (kv_cache.py). Nothing else is written.
      A backend that CUDA graphs capture (triton) writes nothing for a negative slot: a
      padding token of a step padded to a graph's shape (specdec/cuda_graphs.py).
    - Captured in a CUDA graph (triton), `plan` and `forward` make everything they index
      with from `meta`'s device tensors and its host-side lengths, which a graph shape
      fixes: no copy from the host and no wait for the GPU.
    - `forward(query, kv, plan, scale)` returns a new [T, Hq, D] tensor in the query's
      dtype: query row t of request b attends, with softmax scale `scale`, to the keys
      `plan.meta` says it sees (the request's context before its query tokens, then the
      causal prefix of its query tokens or, with a tree mask, exactly the marked ones),
      read through the request's block table. Hq is a multiple of Hkv (GQA). Every KV
      cache dtype (fp32, fp16, bf16, fp8) is read. Slots no row sees may hold anything,
      NaN included, without changing the result.
    - Row invariance: a row's result depends only on its query and the keys it sees, not
      on the other rows of the batch, so a verify row equals, bit for bit, the decode
      step that sees the same keys (lossless greedy speculation rests on it).
    - Results agree with kernels/reference.py's dense attention within fp32 rounding.
    """

    name: str = ""

    @abstractmethod
    def plan(self, meta: AttentionMetadata, kv: PagedKV) -> PlanT:
        """The step's plan, reused by every layer."""

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv: PagedKV,
        plan: PlanT,
    ) -> None:
        """Write this step's K and V into the cache at the plan's slots."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        kv: PagedKV,
        plan: PlanT,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Attention of every query row over the keys it sees."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
