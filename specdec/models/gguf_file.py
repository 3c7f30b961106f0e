"""A .gguf file checked field by field before anything reads it: a truncated or corrupt
file fails with one GGUFFileError that names the file, whether it is truncated or corrupt,
and the field, where GGUFReader or transformers would fail with a numpy or unicode error
naming neither (or not until a tensor is read)."""
from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS


class GGUFFileError(ValueError):
    """A .gguf file that is truncated or corrupt; the message names the file and the field."""


class GGUFTruncatedError(GGUFFileError):
    """A field that runs past the end of the file."""


def check_gguf(path: Path) -> None:
    """GGUFFileError unless every field of the file (header, metadata, tensor infos) is
    whole and well formed and every tensor's bytes lie inside it. GGUFReader would
    otherwise fail on such a file with a numpy or unicode error naming neither file nor
    field, or not at all until a tensor is read."""
    size = path.stat().st_size
    if size == 0:  # mmap refuses an empty file
        raise _Walk(path, b"").truncated("header", 4)
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _Walk(path, data).check()


# Bytes of each fixed-size GGUF value type.
_SCALAR_BYTES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_MIN_KEY_BYTES = 8 + 4 + 1  # a key's length, its value's type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # a name's length, its dimension count, type and data offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
_GGML_TYPES = frozenset(t.value for t in GGMLQuantizationType)
_T = TypeVar("_T")


class _Walk:
    """A GGUF file read field by field as the format lays it out (header, metadata keys,
    tensor infos, then the tensors' data), so that a failure names its field. Truncated: a
    field runs past the end of the file; corrupt: a field holds what no GGUF writer
    writes (a length or count larger than the whole file included)."""

    def __init__(self, path: Path, data: mmap.mmap | bytes):
        self.path, self.data, self.size = path, data, len(data)
        self.pos, self.order, self.alignment = 0, "<", _DEFAULT_ALIGNMENT
        self.keys: set[str] = set()
        self.tensor_names: set[str] = set()

    def corrupt(self, field: str, detail: str) -> GGUFFileError:
        return GGUFFileError(f"{self.path} is not a readable GGUF file: it is corrupt ({field}): {detail}")

    def truncated(self, field: str, end: int, what: str = "it") -> GGUFFileError:
        return GGUFTruncatedError(f"{self.path} is not a readable GGUF file: it is truncated ({field}): {what} "
                                  f"needs bytes up to {end} but the file has {self.size}")

    def check(self) -> None:
        tensor_count, key_count = self._header()
        self._each(key_count, _MIN_KEY_BYTES, "metadata key count field", "metadata keys", self._key)
        tensors = self._each(tensor_count, _MIN_TENSOR_INFO_BYTES, "tensor count field", "tensors",
                             lambda index: self._tensor_info(index, tensor_count))
        self._tensor_data(tensors)

    def _each(self, count: int, least: int, field: str, items: str, walk: Callable[[int], _T]) -> list[_T]:
        """walk(index) for each of `count` items of at least `least` bytes. A count that
        could not fit in the file is blamed once an item reads as garbage; running into the
        end of the file instead is truncation, which makes any count look too large."""
        walked = []
        for index in range(count):
            try:
                walked.append(walk(index))
            except GGUFTruncatedError:
                raise
            except GGUFFileError as error:
                if count * least <= self.size:
                    raise
                detail = (f"{count} {items} would take at least {count * least} bytes, more than the whole file's "
                          f"{self.size}; {items} #{index} on read as garbage")
                raise self.corrupt(field, detail) from error
        return walked

    def _read(self, fmt: str, field: str) -> tuple[Any, ...]:
        end = self.pos + struct.calcsize(self.order + fmt)
        if end > self.size:
            raise self.truncated(field, end)
        values = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos = end
        return values

    def _skip(self, length: int, field: str) -> int:
        """Step over `length` bytes; where they start."""
        if length > self.size:
            raise self.corrupt(field, f"a length of {length} bytes, more than the whole file's {self.size}")
        if self.pos + length > self.size:
            raise self.truncated(field, self.pos + length)
        start, self.pos = self.pos, self.pos + length
        return start

    def _text(self, field: str) -> str:
        start = self._skip(self._read("Q", field)[0], field)
        try:
            return bytes(self.data[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.corrupt(field, f"its name is not UTF-8 text: {error}") from None

    def _header(self) -> tuple[int, int]:
        magic = bytes(self.data[:4])
        if magic != b"GGUF":
            if b"GGUF".startswith(magic):
                raise self.truncated("header", 4)
            raise self.corrupt("header: bad magic", f"it starts with {magic!r}, not b'GGUF': not a GGUF file")
        self.pos = 4
        (version,) = self._read("I", "header: version")
        if version & 0xFFFF == 0:  # written on a big-endian machine, as GGUFReader reads it
            self.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in READER_SUPPORTED_VERSIONS:
            raise self.corrupt("header: version", f"version {version} is not one GGUF reads "
                                                  f"({READER_SUPPORTED_VERSIONS})")
        tensor_count: int = self._read("Q", "tensor count field")[0]
        key_count: int = self._read("Q", "metadata key count field")[0]
        return tensor_count, key_count

    def _key(self, index: int) -> None:
        name = self._unique(self._text(f"metadata key #{index}"), self.keys, f"metadata key #{index}")
        field = f"metadata key {name!r}"
        (raw_type,) = self._read("I", f"{field}: value type")
        if name == "general.alignment":
            self._alignment(raw_type, field)
        else:
            self._value(raw_type, field)

    def _unique(self, name: str, seen: set[str], field: str) -> str:
        if name in seen:
            raise self.corrupt(field, f"a second {name!r}")
        seen.add(name)
        return name

    def _alignment(self, raw_type: int, field: str) -> None:
        """The tensors' alignment, which places their data (GGUFReader wants a uint32)."""
        if raw_type != GGUFValueType.UINT32:
            raise self.corrupt(f"{field}: value type", f"{raw_type}, not a uint32 ({GGUFValueType.UINT32.value})")
        (self.alignment,) = self._read("I", field)
        if self.alignment == 0 or self.alignment & (self.alignment - 1):
            raise self.corrupt(field, f"alignment {self.alignment} is not a power of two")

    def _value(self, raw_type: int, field: str) -> None:
        kind = self._value_type(raw_type, field)
        if kind == GGUFValueType.STRING:
            self._skip(self._read("Q", field)[0], field)
        elif kind == GGUFValueType.ARRAY:
            (item_type,) = self._read("I", f"{field}: array item type")
            least = _SCALAR_BYTES.get(self._value_type(item_type, field), 8)  # a string's or array's length: 8
            (count,) = self._read("Q", f"{field}: array length")
            if item_type in _SCALAR_BYTES:
                self._skip(count * least, f"{field}: array length")
            else:
                self._each(count, least, f"{field}: array length", "items", lambda _: self._value(item_type, field))
        else:
            self._skip(_SCALAR_BYTES[kind], field)

    def _value_type(self, raw_type: int, field: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw_type)
        except ValueError:
            raise self.corrupt(f"{field}: value type", f"{raw_type} is not a GGUF value type") from None

    def _tensor_info(self, index: int, count: int) -> _TensorSpan:
        field = f"tensor info #{index} (the tensor count field says {count})"
        name = self._unique(self._text(field), self.tensor_names, field)
        if not name:
            raise self.corrupt(field, "an empty tensor name")
        field = f"tensor info {name!r}"
        (n_dims,) = self._read("I", field)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise self.corrupt(f"{field}: dimension count", f"{n_dims} dimensions (a GGUF tensor has 1 to {_MAX_DIMS})")
        dims = self._read(f"{n_dims}Q", field)
        raw_type, offset = self._read("IQ", field)
        if raw_type not in _GGML_TYPES:
            raise self.corrupt(f"{field}: type", f"{raw_type} is not a GGML tensor type")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        if dims[0] % block:
            raise self.corrupt(f"{field}: shape", f"rows of {dims[0]} do not fill its type's {block}-element blocks")
        if offset % self.alignment:
            raise self.corrupt(f"{field}: data offset", f"{offset} is not a multiple of the alignment {self.alignment}")
        size = int(np.prod(dims, dtype=object)) // block * block_bytes  # Python ints: a corrupt shape must not overflow
        if size > self.size:
            raise self.corrupt(f"{field}: shape", f"{list(dims)} takes {size} bytes, more than the whole file's "
                                                  f"{self.size}")
        return _TensorSpan(name, offset, size)

    def _tensor_data(self, tensors: list[_TensorSpan]) -> None:
        """Every tensor's bytes inside the file. The tensors lie packed after the infos
        (each padded to the alignment), so an offset past their total is corrupt, not a
        sign of truncation."""
        start = self.pos + -self.pos % self.alignment
        total = sum(t.size + -t.size % self.alignment for t in tensors)
        for tensor in sorted(tensors, key=lambda t: t.offset):
            if tensor.offset + tensor.size > total:
                raise self.corrupt(f"tensor info {tensor.name!r}: data offset", f"{tensor.offset} puts its "
                                   f"{tensor.size} bytes past the {total} that all the tensors take together")
            if start + tensor.offset + tensor.size > self.size:
                raise self.truncated("tensor data", start + tensor.offset + tensor.size, f"tensor {tensor.name!r}")


class _TensorSpan(NamedTuple):
    """Where a tensor's bytes lie: from `offset` in the data section, `size` of them."""

    name: str
    offset: int
    size: int
