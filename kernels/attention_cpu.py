"""Paged attention on the CPU through the C++ kernel (csrc/paged_attention.cpp).

Every query row, prefill or decode, verify row or tree node, reads its keys straight from
the paged cache through its request's block table: no gathered copy, no padding, no SDPA
call per row. A row is described by its request, a prefix length (it sees the request's
first `prefix` positions) and, for tree nodes off the first path, extra positions (its
ancestors among the query tokens). The rows of a request form groups whose common keys
are read once for all of them, so a verify costs little more than a decode and a prefill
chunk's causal attention reads each key once per group of rows. The kernel is
row-invariant: speculation stays token-identical to plain decoding.

`CppAttention` is the `cpp` attention backend: this kernel and the C++ K/V store
(store_kv_cpu.py), each stepping aside to the torch backend's code for what it lacks (a
head dim it is not built for, non-fp32 queries, fp8 stores).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from specdec.kernels import cpu_build, store_kv_cpu
from specdec.kernels.attention_base import AttentionBackend, AttentionPlan
from specdec.kernels.attention_torch import TorchPlan, paged_attention_torch, plan_torch, store_kv_torch
from specdec.kernels.kv_cache import FP8, PagedKV
from specdec.kernels.metadata import AttentionMetadata

_CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, FP8: 3}
_LIBRARY = "paged_attention"
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int32] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + \
    [ctypes.c_float, ctypes.c_int32, ctypes.c_int64]
_GROUP_ROWS = 32  # rows per group at most: a prefill chunk is split for balance across threads


@dataclass
class CppRows:
    """The query rows of a step, as the kernel reads them: [R] each unless noted. Rows
    come in groups, each of one request: the kernel reads the keys every row of a group
    sees once for all of them (a verify's rows, a tree's nodes)."""

    rows: torch.Tensor  # query rows
    prefixes: torch.Tensor  # the row sees positions 0..prefix-1 of its request
    extra_start: torch.Tensor  # [R + 1] CSR offsets into extra
    extra: torch.Tensor  # [E] further positions each row sees, in order
    group_start: torch.Tensor  # [num_groups + 1] CSR offsets into the rows
    group_requests: torch.Tensor  # [num_groups] the request (block table row) of each group
    tables: torch.Tensor  # [B, max_blocks] int32 contiguous block tables
    head_splits: int  # work items per group: its kv heads in this many shares


def supports_cache(kv: PagedKV) -> bool:
    """Whether the kernel can read this cache here (its device, dtype and head dim); loads it.
    It also needs float32 queries."""
    return kv.k.device.type == "cpu" and kv.k.dtype in _CACHE_DTYPES and _supports_head_dim(kv.k.shape[-1])


@functools.cache
def _supports_head_dim(head_dim: int) -> bool:
    supports_dim = cpu_build.function(_LIBRARY, "specdec_paged_attention_supports", [ctypes.c_int64], ctypes.c_int32)
    return bool(supports_dim(head_dim))


KernelBuildError = cpu_build.KernelBuildError


def load() -> None:
    """Build (first time on this machine) and load the kernel; KernelBuildError if it cannot."""
    cpu_build.load(_LIBRARY)


def builds() -> bool:
    """Whether the kernel builds and loads here (tried once per process; if not, one
    warning says the torch attention backend is used instead)."""
    return cpu_build.builds(_LIBRARY, "the torch attention backend (slower)")


@dataclass
class CppPlan(AttentionPlan):
    """The kernel's rows, or None where it cannot read the cache (the torch code then
    runs every layer); the torch plan is built only if some query needs it."""

    rows: CppRows | None
    block_size: int
    device: torch.device

    @functools.cached_property
    def torch_plan(self) -> TorchPlan:
        return plan_torch(self.meta, self.block_size, self.device)


class CppAttention(AttentionBackend[CppPlan]):
    """The C++ kernels; constructing it builds them (KernelBuildError if they cannot build)."""

    name = "cpp"

    def __init__(self) -> None:
        load()

    def plan(self, meta: AttentionMetadata, kv: PagedKV) -> CppPlan:
        rows = plan_rows(meta, kv.k.shape[2]) if supports_cache(kv) else None
        return CppPlan(meta, rows, kv.block_size, kv.k.device)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv: PagedKV, plan: CppPlan) -> None:
        slot_mapping = plan.meta.slot_mapping
        if store_kv_cpu.supports(key, value, kv, slot_mapping):
            store_kv_cpu.store_kv_cpu(key, value, kv, slot_mapping)
        else:
            store_kv_torch(key, value, kv, slot_mapping)

    def forward(self, query: torch.Tensor, kv: PagedKV, plan: CppPlan, scale: float) -> torch.Tensor:
        if plan.rows is not None and query.dtype == torch.float32 and query.device.type == "cpu":
            return paged_attention_cpu(query, kv, plan.rows, scale)
        return paged_attention_torch(query, kv, plan.torch_plan, scale)


def paged_attention_cpu(
    query: torch.Tensor,  # [T, Hq, D] float32
    kv: PagedKV,
    rows: CppRows,  # from plan_rows for this step and kv's kv heads
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    query = query.contiguous()  # the kernel reads and writes [T, Hq, D] rows densely
    out = torch.empty_like(query)
    _attend_rows(query, out, kv, rows, scale)
    return out


def _attend_rows(query: torch.Tensor, out: torch.Tensor, kv: PagedKV, rows: CppRows, scale: float) -> None:
    tables = rows.tables
    _, block_size, num_kv_heads, head_dim = kv.k.shape
    attend = cpu_build.function(_LIBRARY, "specdec_paged_attention_rows", _ARGTYPES)
    attend(
        _ptr(query), _ptr(out), _ptr(kv.k), _ptr(kv.v), _ptr(kv.k_scale), _ptr(kv.v_scale),
        _CACHE_DTYPES[kv.k.dtype], _ptr(tables), _ptr(rows.rows), _ptr(rows.prefixes), _ptr(rows.extra_start),
        _ptr(rows.extra), _ptr(rows.group_start), _ptr(rows.group_requests), rows.group_requests.numel(),
        query.shape[1], num_kv_heads, head_dim, block_size, tables.shape[1], scale, torch.get_num_threads(),
        rows.head_splits)


def _ptr(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError(f"the C++ attention kernel needs contiguous tensors, got strides {tensor.stride()}")
    return tensor.data_ptr()


def plan_rows(meta: AttentionMetadata, num_kv_heads: int) -> CppRows:
    """The step's query rows as the kernel reads them, split into work items for this
    many threads (the split never changes a bit of the result)."""
    rows: list[int] = []
    prefixes: list[int] = []
    extra_start = [0]
    extra: list[int] = []
    group_start = [0]
    group_requests: list[int] = []
    requests = meta.num_requests
    # A work item is a group's kv heads. Aim for two items per thread: split the kv heads
    # of each group first, then the rows of each request.
    wanted = 2 * torch.get_num_threads()
    head_splits = min(num_kv_heads, -(-wanted // max(1, requests)))
    parts = -(-wanted // max(1, requests * head_splits))
    for b in range(requests):
        keys = meta.visible_keys(b)
        if not keys:
            continue
        size = min(-(-len(keys) // min(parts, len(keys))), _GROUP_ROWS)
        for first in range(0, len(keys), size):
            for row, prefix, seen in keys[first : first + size]:
                rows.append(row)
                prefixes.append(prefix)
                extra.extend(seen)
                extra_start.append(len(extra))
            group_start.append(len(rows))
            group_requests.append(b)
    # One tensor, sliced: each torch.tensor call costs tens of microseconds on a decode
    # step's cold caches.
    lists = (rows, prefixes, extra_start, extra, group_start, group_requests)
    flat = torch.tensor([x for xs in lists for x in xs], dtype=torch.int64).split([len(xs) for xs in lists])
    return CppRows(flat[0], flat[1], flat[2], flat[3], flat[4], flat[5], meta.block_tables.to(torch.int32).contiguous(),
                   head_splits)

