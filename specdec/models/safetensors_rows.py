"""A safetensors shard read through a memory map of our own, a range of rows at a time, the
pages of each range given back to the kernel once the loader has copied it.

safetensors' own `safe_open` maps the file too, but every page a tensor touched stays
resident until the file closes: a bf16 checkpoint loaded onto the CPU peaked at the model
plus the whole file (2.0x the checkpoint, measured), and onto a GPU at the whole file on
the host. Here the host holds one chunk of the file at a time. The format is the header
safetensors documents: 8 bytes of little-endian header length, a JSON header of name ->
dtype, shape and byte offsets into the data that follows it.
"""
from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets into the file
    stop: int


class SafetensorsRows:
    """One shard's tensors by name, read as row ranges (views of the map, never copied here)."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as file:
            # Copy-on-write, so that torch.frombuffer gets a writable buffer; nothing writes to it.
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        self.entries = _read_header(self._map, path)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def chunks(self, name: str, max_rows: int) -> Iterator[tuple[int, Tensor]]:
        """(first row, [<= max_rows, *shape[1:]] view) over the tensor's leading dimension (a
        0-d or 1-d tensor comes whole); each view's pages are released once the caller asks
        for the next, so it must be copied before then and not kept."""
        entry = self.entries[name]
        if len(entry.shape) <= 1 or 0 in entry.shape:
            yield 0, self._view(entry, 0, entry.shape[0] if entry.shape else 1).reshape(entry.shape)
            self._release(entry.start, entry.stop)
            return
        row_bytes = (entry.stop - entry.start) // entry.shape[0]
        for first in range(0, entry.shape[0], max_rows):
            rows = min(max_rows, entry.shape[0] - first)
            yield first, self._view(entry, first, rows)
            start = entry.start + first * row_bytes
            self._release(start, start + rows * row_bytes)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view still held (an error's traceback): unmapped when it goes
            pass

    def _view(self, entry: _Entry, first: int, rows: int) -> Tensor:  # [rows, *shape[1:]]
        numel_per_row = 1
        for dim in entry.shape[1:]:
            numel_per_row *= dim
        if rows * numel_per_row == 0:
            return torch.empty((rows, *entry.shape[1:]), dtype=entry.dtype)
        row_bytes = numel_per_row * entry.dtype.itemsize
        flat = torch.frombuffer(self._map, dtype=entry.dtype, count=rows * numel_per_row,
                                offset=entry.start + first * row_bytes)
        return flat.view(rows, *entry.shape[1:])

    def _release(self, start: int, stop: int) -> None:
        """Give the pages of [start, stop) back: private and never written, they are
        dropped, not swapped, and a later read maps them in again from the page cache."""
        page = mmap.PAGESIZE
        first = start // page * page
        if stop > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, stop - first)


def _read_header(data: mmap.mmap, path: Path) -> dict[str, _Entry]:
    """name -> entry; ValueError naming the file for a header that is not a safetensors one."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
    except (struct.error, ValueError) as error:
        raise ValueError(f"{path} is not a safetensors file: {error}") from error
    header.pop("__metadata__", None)
    base, entries = 8 + length, {}
    for name, info in header.items():
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which the loader does not read "
                             f"(one of {', '.join(DTYPES)})")
        start, stop = info["data_offsets"]
        entries[name] = _Entry(dtype, tuple(int(d) for d in info["shape"]), base + start, base + stop)
        if base + stop > len(data):
            raise ValueError(f"{path} is truncated: tensor {name} ends at byte {base + stop} of {len(data)}")
    return entries
