"""A llama-architecture GGUF file read directly: its model config and EOS from the
metadata and its tensors under HF names, for loader.py (its tokenizer: tokenizer.py).

Tensors come either dequantized to float32 a range of rows at a time (`keep_blocks=False`:
the model then equals the dequantized HF checkpoint `specdec models pull` writes) or, for
`quantization="gguf"`, as the file's own blocks (`QuantizedMatrix`, no float copy) wherever
their type is one the C++ kernels run; q and k rows are reordered from llama.cpp's RoPE
layout to HF's either way (whole rows, so the blocks are kept as they are). A file that is not a
readable GGUF, an architecture or tensor other than a llama's, or a tensor type that
cannot be loaded is a ValueError naming it: a truncated or corrupt file a GGUFFileError
naming the file and the field (`check_gguf`, run before anything else reads the file).
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from torch import Tensor

from specdec.kernels.gguf_blocks import BLOCK_TYPES, QuantizedMatrix
from specdec.models.config import ModelConfig
from specdec.models.gguf_file import GGUFFileError, check_gguf
from specdec.models.gguf_names import hf_name, qk_row_order

SUPPORTED_ARCHITECTURES = ("llama",)
BLOCK_NAMES = {ggml_type: name for name, ggml_type in BLOCK_TYPES.items()}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# What a GGUFReader raises on a truncated or damaged file.
_READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error, UnicodeDecodeError)


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def keeps_blocks(path: str | Path) -> bool:
    """Whether quantization "gguf" runs this file: every tensor is float or a block type
    the quantized kernels read (False for a file that is missing or unreadable, which
    loading then reports)."""
    try:
        reader = open_gguf(path)
    except (OSError, ValueError):
        return False
    return all(_kept_as_is(t.tensor_type) for t in reader.tensors)


def _kept_as_is(tensor_type: GGMLQuantizationType) -> bool:
    """Whether quantization "gguf" keeps a tensor of this type as stored (blocks the kernels
    read, or floats); any other type it refuses."""
    return tensor_type in BLOCK_NAMES or tensor_type in FLOAT_TYPES


def open_gguf(path: str | Path) -> GGUFReader:
    """The file's reader (memory-mapped copy-on-write: nothing is written back);
    FileNotFoundError if it is missing, GGUFFileError if it is truncated, corrupt or not
    a GGUF."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file {path}")
    check_gguf(path)
    try:
        return GGUFReader(path, "c")
    except _READ_ERRORS as error:  # a damage the walk does not look for
        raise GGUFFileError(f"{path} is not a readable GGUF file: it is corrupt: {error}") from error


def model_config(reader: GGUFReader) -> ModelConfig:
    """The model's config from the metadata, as an HF config.json would give it."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads, hidden = int(_field(reader, f"{arch}.attention.head_count")), int(_field(reader, f"{arch}.embedding_length"))
    raw: dict[str, Any] = {
        "model_type": arch, "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
        "hidden_size": hidden, "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
    }
    return ModelConfig.from_dict(raw)


def _field(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"the GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (none or linear)")
    return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}


class GgufTensors:
    """The file's tensors by HF name, in the checkpoint interface loader.py reads: a
    tensor's shape, its blocks where they are kept, else its rows dequantized a range at
    a time (so a bf16 load never holds a whole weight in float32)."""

    def __init__(self, reader: GGUFReader, config: ModelConfig, keep_blocks: bool):
        self.config, self.keep_blocks = config, keep_blocks
        self.by_name: dict[str, ReaderTensor] = {}
        for tensor in reader.tensors:
            self.by_name[hf_name(tensor.name)] = tensor

    def keys(self) -> list[str]:
        return list(self.by_name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.by_name[name].shape))  # GGUF lists dims innermost first

    def blocks(self, name: str) -> QuantizedMatrix | None:
        """`name`'s blocks where keep_blocks keeps them, else None (read its rows as floats);
        ValueError for a block type the kernels do not run: it would take a float32 copy."""
        tensor = self.by_name[name]
        if not self.keep_blocks or tensor.tensor_type in FLOAT_TYPES:
            return None
        if tensor.tensor_type not in BLOCK_NAMES:
            raise ValueError(f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which quantization "
                             f"'gguf' does not run (block types: {', '.join(t.name for t in BLOCK_NAMES)}); load it "
                             "with quantization 'none', or quantize it at load with q8_0, q4_0 or q4_1")
        order = self._row_order(name)
        blocks = torch.from_numpy(tensor.data)
        if order is not None:
            blocks = blocks.index_select(0, order)  # whole rows: the blocks stay as they are
        return QuantizedMatrix(BLOCK_NAMES[tensor.tensor_type], blocks, self.shape(name)[-1])

    def chunks(self, name: str, max_rows: int) -> Iterator[tuple[int, Tensor]]:
        """(first row, float32 [<= max_rows, cols]) dequantized, q and k rows in HF's order;
        a 1-d tensor comes whole."""
        tensor, shape = self.by_name[name], self.shape(name)
        if len(shape) <= 1:
            yield 0, self._floats(tensor, tensor.data).reshape(shape)
            return
        order = self._row_order(name)
        for first in range(0, shape[0], max_rows):
            rows = slice(first, min(first + max_rows, shape[0]))
            data = tensor.data[rows] if order is None else tensor.data[order[rows].numpy()]
            yield first, self._floats(tensor, data).reshape(-1, *shape[1:])

    def _floats(self, tensor: ReaderTensor, data: np.ndarray[Any, Any]) -> Tensor:
        try:
            values = dequantize(data, tensor.tensor_type)
        except NotImplementedError as error:
            raise ValueError(f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which cannot be "
                             f"loaded: {error}") from error
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def _row_order(self, name: str) -> Tensor | None:  # [rows] int64
        """Which GGUF row each HF row of a q or k projection is (llama.cpp stores them in its
        RoPE layout); None for every other tensor."""
        heads = {"q_proj": self.config.num_heads, "k_proj": self.config.num_kv_heads}
        head = next((h for proj, h in heads.items() if name.endswith(f"{proj}.weight")), None)
        return None if head is None else qk_row_order(self.shape(name)[0], head)
