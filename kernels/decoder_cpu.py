"""Every decoder layer of a Llama-family model in one C++ call on the CPU
(csrc/decoder_layers.cpp).

Driven from Python, a decode step of the default model (30 layers, about twelve small
operations each) spends as long dispatching as multiplying. `DecoderLayers` holds what
the C++ loop reads: the other kernels' entry points, the token embedding table, and per
layer its norms, its four projections as their kernels take them and its K/V cache. The
loop calls exactly the kernels the Python forward calls (linear_quant and its exact row
lookup, linear_fp16, rms_norm, store_kv, paged attention), so it stays batch invariant;
its own arithmetic (RoPE, SiLU in vector lanes, the residual adds) is row-wise.
specdec/models/llama.py's layer code is its reference (tests/kernels/test_decoder_cpu.py).

`runs_embedding`, `runs_projection` and `supports_cache` say what it runs: a float32 or
one-segment GGUF embedding table, the linear backends "gguf"/q8_0/q4_0/q4_1 (one block
segment per projection) or "cpp-fp16", and a cache the C++ attention and K/V store read
(fp32, fp16 or bf16); its caller (specdec/executor.py's CppLayerLoop) checks the rest
(float32, no q/k norm) and builds a new `DecoderLayers` when the projections are repacked.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specdec.kernels import attention_cpu, cpu_build, linear_cpu, linear_quant
from specdec.kernels.attention_cpu import CppRows
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.linear_base import LinearBackend
from specdec.kernels.linear_cpu import CppFp16Linear
from specdec.kernels.linear_gguf import GgufLinear
from specdec.kernels.quantized_tensor import QuantizedTensor
from specdec.kernels.store_kv_cpu import CACHE_DTYPES

_LIBRARY = "decoder_layers"
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_KINDS = {"float32": 0, "int8": 1}  # GGUF blocks with these activations; 2: fp16 tiles


_FLOAT_ROWS = -1  # an embedding table of float32 rows (else a linear_quant format id)


class _Kernels(ctypes.Structure):
    _fields_ = [("linear_quant", _P), ("linear_quant_int8", _P), ("dequantize_rows", _P), ("linear_fp16", _P),
                ("rms_norm", _P), ("store_kv", _P), ("attention", _P)]


class _Projection(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("format", ctypes.c_int32), ("weight", _P), ("bias", _P), ("rows", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("k_cache", _P), ("v_cache", _P)]


class _Embedding(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int32), ("table", _P), ("rows", _I64)]


class _Step(ctypes.Structure):
    _fields_ = [("token_ids", _P), ("embedding", _Embedding),
                ("tokens", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", _P), ("sin", _P),
                ("positions", _P), ("slots", _P), ("num_slots", _I64), ("cache_dtype", ctypes.c_int32),
                ("block_size", _I64), ("max_blocks", _I64), ("block_tables", _P), ("rows", _P), ("prefixes", _P),
                ("extra_start", _P), ("extra", _P), ("group_start", _P), ("group_requests", _P),
                ("num_groups", _I64), ("head_splits", _I64), ("num_threads", ctypes.c_int32), ("final_norm", _P),
                ("capture", _P), ("capture_layers", _P), ("num_captures", _I64)]


@dataclass(frozen=True)
class Shape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


@dataclass(frozen=True)
class LayerWeights:
    """One layer as the loop reads it: norms [hidden] float32, projections as their
    backend packed them."""

    input_norm: Tensor
    post_norm: Tensor
    projections: tuple[tuple[LinearBackend, Any], ...]  # (backend, packed) of qkv, o, gate_up, down


def builds() -> bool:
    """Whether the loop and every kernel it calls build and load here (tried once per process)."""
    return (cpu_build.builds(_LIBRARY, "the Python layer loop") and linear_quant.builds() and linear_cpu.builds()
            and attention_cpu.builds() and cpu_build.builds("rms_norm", "torch's rms_norm")
            and cpu_build.builds("store_kv", "torch's index_copy_"))


def runs_projection(backend: LinearBackend, packed: Any) -> bool:
    """Whether the loop can run this projection (see _projection)."""
    return _projection(backend, packed) is not None


def _projection(backend: LinearBackend, packed: Any) -> _Projection | None:
    """The C struct of one projection and the tensors it points into, or None if the loop
    cannot run it: GGUF blocks in one segment without padding, or fp16 tiles."""
    if isinstance(backend, GgufLinear):
        parts, rest = packed
        if parts is None:  # a float weight: rest is its fp16 packing
            return _fp16_projection(rest)
        if len(parts) != 1 or parts[0].padded_cols != parts[0].cols:
            return None
        part = parts[0]  # rest is the bias
        return _Projection(_KINDS[backend.activations], part.format_id, part.groups.data_ptr(), _ptr(rest), part.rows)
    if isinstance(backend, CppFp16Linear):
        return _fp16_projection(packed)
    return None


def _fp16_projection(packed: tuple[Tensor, Tensor | None, int]) -> _Projection:
    weight, bias, rows = packed
    return _Projection(2, 0, weight.data_ptr(), _ptr(bias), rows)


def _ptr(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def runs_embedding(table: Tensor) -> bool:
    """Whether the loop can look up rows of this [vocab, hidden] embedding table (see _embedding)."""
    return _embedding(table) is not None


def _embedding(table: Tensor) -> _Embedding | None:
    """The C struct of an embedding table: float32 rows, or GGUF blocks in one segment
    without padding; None for any other."""
    if isinstance(table, QuantizedTensor):
        if len(table.parts) != 1 or table.parts[0].padded_cols != table.parts[0].cols:
            return None
        part = table.parts[0]
        return _Embedding(part.format_id, part.groups.data_ptr(), part.rows)
    if table.dtype != torch.float32 or table.device.type != "cpu" or not table.is_contiguous():
        return None
    return _Embedding(_FLOAT_ROWS, table.data_ptr(), table.shape[0])


def supports_cache(kv: PagedKV) -> bool:
    """Whether the loop's K/V store and attention read and write this cache."""
    return (kv.k.dtype in CACHE_DTYPES and kv.k_scale is None and kv.k.is_contiguous() and kv.v.is_contiguous()
            and attention_cpu.supports_cache(kv))


class DecoderLayers:
    """A model's token embedding, layers and final norm for the C++ loop. Holds the
    weights' tensors (their pointers stay valid while it lives); the caller builds a new
    one after repacking them."""

    def __init__(self, shape: Shape, embedding: Tensor, layers: list[LayerWeights],
                 final_norm: Tensor) -> None:  # embedding [vocab, hidden] passing runs_embedding; final_norm [hidden]
        self.shape = shape
        table = _embedding(embedding)
        if table is None:
            raise ValueError("the embedding table is not one the C++ layer loop reads")
        self._table, self._embedding = embedding, table  # the tensor kept alive: the struct points into it
        self._weights = layers  # kept alive: the structs point into them
        self._final_norm = final_norm
        self._layers = (_Layer * len(layers))()
        for struct, layer in zip(self._layers, layers, strict=True):
            projections = [_projection(*pair) for pair in layer.projections]
            if any(p is None for p in projections):
                raise ValueError("a projection's backend or packing is not one the C++ layer loop runs")
            struct.input_norm, struct.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            struct.qkv, struct.o, struct.gate_up, struct.down = projections
        self._caches: tuple[int, ...] = ()
        self._kernels = _kernels()

    def run(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        rope_cos: Tensor,  # [P, D] float32: the model's whole table
        rope_sin: Tensor,  # [P, D] float32
        kv_caches: list[PagedKV],  # one per layer, each passing supports_cache
        slot_mapping: Tensor,  # [T] int64
        rows: CppRows,  # attention_cpu.plan_rows of this step
        scale: float,
        # (layer ids, out [T, len(ids) * hidden] float32 contiguous): the residual stream
        # entering each of those layers is copied into its column block (EAGLE-3's features)
        capture: tuple[Sequence[int], Tensor] | None = None,
    ) -> Tensor:  # [T, hidden] float32: the final norm's output
        self._point_at(kv_caches)
        kv = kv_caches[0]
        s = self.shape
        input_ids = input_ids.to(torch.int64).contiguous()
        positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
        hidden = torch.empty(input_ids.shape[0], s.hidden, dtype=torch.float32)
        step = _Step(input_ids.data_ptr(), self._embedding,
                     hidden.shape[0], s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate, s.eps, scale,
                     rope_cos.data_ptr(), rope_sin.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
                     kv.k.shape[0] * kv.k.shape[1], CACHE_DTYPES[kv.k.dtype], kv.block_size, rows.tables.shape[1],
                     rows.tables.data_ptr(), rows.rows.data_ptr(), rows.prefixes.data_ptr(),
                     rows.extra_start.data_ptr(), rows.extra.data_ptr(), rows.group_start.data_ptr(),
                     rows.group_requests.data_ptr(), rows.group_requests.numel(), rows.head_splits,
                     torch.get_num_threads(), self._final_norm.data_ptr())
        _columns = self._capture(step, capture)  # held until the call returns: the step points into it
        run = cpu_build.function(_LIBRARY, "specdec_decoder_layers",
                                 [ctypes.POINTER(_Kernels), ctypes.POINTER(_Layer), _I64, ctypes.POINTER(_Step), _P],
                                 ctypes.c_int32)
        status = run(ctypes.byref(self._kernels), self._layers, len(self._layers), ctypes.byref(step),
                     hidden.data_ptr())
        if status == 2:
            raise IndexError(f"a slot of {slot_mapping.tolist()} is outside the cache's {step.num_slots} slots")
        if status == 3:
            bad = input_ids[(input_ids < 0) | (input_ids >= self._embedding.rows)]
            raise IndexError(f"token id {int(bad[0])} is outside the embedding's {self._embedding.rows} rows")
        if status != 0:
            raise ValueError("the quantized linear kernel has no variant for this CPU")
        return hidden

    def _capture(self, step: _Step, capture: tuple[Sequence[int], Tensor] | None) -> Tensor | None:
        """Point the step at the capture buffer; the layer ids it reads (None without capture)."""
        if capture is None:
            return None
        layer_ids, out = capture
        width = len(layer_ids) * self.shape.hidden
        if out.dtype != torch.float32 or not out.is_contiguous() or tuple(out.shape) != (step.tokens, width):
            raise ValueError(f"the capture buffer must be contiguous float32 [{step.tokens}, {width}], "
                             f"got {out.dtype} {tuple(out.shape)}")
        ids = torch.tensor(list(layer_ids), dtype=torch.int64)
        step.capture, step.capture_layers, step.num_captures = out.data_ptr(), ids.data_ptr(), len(layer_ids)
        return ids

    def _point_at(self, kv_caches: list[PagedKV]) -> None:
        caches = tuple(ptr for kv in kv_caches for ptr in (kv.k.data_ptr(), kv.v.data_ptr()))
        if caches != self._caches:
            for struct, kv in zip(self._layers, kv_caches, strict=True):
                struct.k_cache, struct.v_cache = kv.k.data_ptr(), kv.v.data_ptr()
            self._caches = caches


def _kernels() -> _Kernels:
    def address(library: str, symbol: str) -> int:
        return ctypes.cast(getattr(cpu_build.load(library), symbol), ctypes.c_void_p).value or 0

    return _Kernels(address("linear_quant", "specdec_linear_quant"),
                    address("linear_quant", "specdec_linear_quant_int8"),
                    address("linear_quant", "specdec_quant_dequantize_rows"),
                    address("linear_fp16", "specdec_linear_fp16"), address("rms_norm", "specdec_rms_norm"),
                    address("store_kv", "specdec_store_kv"), address("paged_attention", "specdec_paged_attention_rows"))

