"""Load a local HF safetensors checkpoint, or a GGUF file, into our LlamaForCausalLM.

Each of our parameters is filled from one or more HF tensors stacked along dim 0 (q/k/v
into qkv_proj, gate/up into gate_up_proj); pieces are copied straight into slices of the
destination, so no fused temporary is ever materialised. Tensors are read through a memory
map of each shard (safetensors' `safe_open`, reopened every MAP_BYTES; the GGUF's own), one
range of rows (CHUNK_BYTES) at a time, converted to the model dtype and copied into parameters
already allocated on the target device in that dtype: a bf16 checkpoint never has a float32
copy, and the host holds about one chunk of the file at a time. With
`quantization="gguf"` a GGUF's projections keep their blocks instead: each such parameter becomes a
QuantizedTensor of its pieces' blocks (kernels/quantized_tensor.py). The model gets its
attention backend at construction and its linear backend once the weights are in.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from specdec.kernels.attention import AttentionBackend, make_attention_backend
from specdec.kernels.gguf_blocks import QUANTIZABLE, QuantizedMatrix, quantize
from specdec.kernels.linear import LinearBackend, get_linear_backend, resolve_linear_backend
from specdec.kernels.linear_gguf import QUANT_BACKENDS, GgufLinear
from specdec.kernels.quantized_tensor import QuantizedTensor
from specdec.models.config import ModelConfig
from specdec.models.gguf_loader import GgufTensors, is_gguf, model_config, open_gguf
from specdec.models.linear import PackedLinear
from specdec.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Checkpoint tensors we know we do not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# How the projections' weights are stored (EngineConfig.quantization): as loaded, in
# float ("none"); a GGUF's own blocks ("gguf"); quantized at load to one block type.
QUANTIZATIONS = ("none", "gguf", "q8_0", "q4_0", "q4_1")
# The most a chunk of a weight read from the file may take, counted in float32 (a GGUF's
# rows come dequantized to it): what a load holds on the host beyond the model itself.
CHUNK_BYTES = 64 << 20
# The bytes per element of the safetensors dtypes the loader reads (converted to the model's
# dtype); the others (packed F4/F6, F8_E8M0 scales, U16-U64, complex) are no float weight.
_ITEMSIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
              "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# The most of a shard's data one safe_open handle reads before it is dropped and the file
# reopened: its map keeps every page read resident until then (SafetensorsShard).
MAP_BYTES = CHUNK_BYTES


@dataclass(frozen=True)
class _Piece:
    """One HF tensor filling `rows` rows (along dim 0) of one of our parameters."""

    hf_name: str
    rows: int
    broadcast: bool = False  # a [D] vector repeated over `rows` heads (q/k norm)


WeightPlan = dict[str, list[_Piece]]  # our parameter name -> pieces, in row order


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    fallback_weights: dict[str, Tensor] | None = None,
    max_positions: int | None = None,
    linear_backend: str = "fp32",
    attention_backend: str | AttentionBackend[Any] = "auto",
    quantization: str = "none",
    quantized_activations: str = "float32",
) -> LlamaForCausalLM:
    """Build the model described by model_dir/config.json and load its safetensors, or
    the model of a .gguf file (model_dir the file) from its metadata and tensors.

    linear_backend names the projections' backend (kernels/linear.py; "auto": the
    default for `dtype`) unless `quantization` (one of QUANTIZATIONS) is not "none":
    then the projections keep a GGUF's own blocks ("gguf") or are quantized at load to
    that block type (no float copy kept; a tied embedding table too), on its backend,
    which quantizes the activations to int8 blocks first if quantized_activations is
    "int8" (lossy, opt-in: kernels/linear_gguf.py).
    attention_backend names the attention backend
    (kernels/attention.py; "auto": the C++ kernels where they build, else torch) or is
    one to share (a draft model shares its target's). ValueError for an unknown or
    unavailable backend, KernelBuildError if attention "cpp" cannot build here.
    fallback_weights (HF names) supply tensors the checkpoint lacks, e.g. a draft model
    stored without the embedding/LM head it shares with its target; a fallback tensor
    already in the right shape, dtype and device is shared, not copied, so the draft adds
    no memory for it. max_positions caps the RoPE table (default: the config's
    max_position_embeddings).
    Raises ValueError for unsupported architectures, GGUF tensor types, quantizations
    and for missing or misshapen weights.
    """
    path = Path(model_dir)
    reader = open_gguf(path) if is_gguf(path) else None
    config = model_config(reader) if reader is not None else ModelConfig.from_dir(path)
    linear = _linear_backend(linear_backend, quantization, dtype, reader is not None, quantized_activations, device)
    float_headers = isinstance(linear, GgufLinear) and linear.float_headers  # how blocks are packed for it
    attention = (make_attention_backend(attention_backend, device) if isinstance(attention_backend, str)
                 else attention_backend)
    model = LlamaForCausalLM(config, attention, dtype=dtype, device=device, max_positions=max_positions)
    plan = weight_plan(config)
    checkpoint = (_open_checkpoint(path) if reader is None
                  else _gguf_checkpoint(GgufTensors(reader, config, keep_blocks=quantization == "gguf")))
    with checkpoint as tensors, torch.no_grad():
        source = _Source(tensors, fallback_weights or {})
        _check_complete(plan, source)
        params = dict(model.named_parameters())
        if set(plan) != set(params):  # a parameter left out would stay uninitialised
            raise RuntimeError(f"weight plan/model mismatch: {set(plan) ^ set(params)}")
        for name, pieces in plan.items():
            shared = _shareable_fallback(params[name], pieces, source)
            if shared is None:
                shared = _fill(params[name], pieces, source, float_headers)
            if shared is not None:
                _replace_parameter(model, name, shared)
        _warn_unused(tensors, plan, config)
    model.tie_weights()
    if quantization in QUANTIZABLE:
        _quantize_linears(model, quantization, float_headers)
    model.use_linear_backend(linear)
    return model.eval()


def _quantize_linears(model: LlamaForCausalLM, qtype: str, float_headers: bool) -> None:
    """Quantize-at-load: every projection's float weight (and with it a tied embedding
    table, whose lookups then read the quantized rows) replaced by its blocks, packed for
    the backend (float_headers: kernels/linear_quant.pack)."""
    blocks: dict[int, QuantizedTensor] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(module, PackedLinear) and name == "weight" and not isinstance(param, QuantizedTensor):
                blocks.setdefault(id(param), QuantizedTensor([quantize(param, qtype)], float_headers))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in blocks:
                setattr(module, name, nn.Parameter(blocks[id(param)], requires_grad=False))


def _linear_backend(name: str, quantization: str, dtype: torch.dtype, gguf: bool,
                    activations: str = "float32", device: torch.device | str = "cpu") -> LinearBackend:
    """The projections' backend: `name`'s, or (whatever `name`) the one `quantization`
    stores them for, with `activations` (EngineConfig.quantized_activations); EngineConfig
    refuses a linear_backend that would be left unused."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {list(QUANTIZATIONS)}")
    if quantization == "none":
        if activations != "float32":
            raise ValueError(f"quantized_activations {activations!r} needs a quantization other than 'none'")
        return get_linear_backend(resolve_linear_backend(name, dtype, device))
    if dtype != torch.float32:
        raise ValueError(f"quantization {quantization!r} needs dtype float32 (activations stay fp32), got {dtype}")
    if quantization != "gguf":
        get_linear_backend(quantization)  # ValueError if it does not run here
        return next(cls for cls in QUANT_BACKENDS if cls.name == quantization)(activations)
    if not gguf:
        raise ValueError("quantization 'gguf' runs a .gguf model's own blocks; this model is an HF directory "
                         "(quantize it at load with q8_0, q4_0 or q4_1 instead)")
    if not GgufLinear.is_available():
        raise ValueError("quantization 'gguf' needs the C++ quantized kernel, which does not run here")
    return GgufLinear(activations)


def weight_plan(config: ModelConfig) -> WeightPlan:
    """Where every one of our parameters comes from in an HF checkpoint."""
    plan: WeightPlan = {
        "embed_tokens": [_Piece("model.embed_tokens.weight", config.vocab_size)],
        "norm": [_Piece("model.norm.weight", config.hidden_size)],
    }
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = [_Piece("lm_head.weight", config.vocab_size)]
    for i in range(config.num_layers):
        plan.update(_attention_plan(config, i))
        plan.update(_mlp_plan(config, i))
    return plan


def _attention_plan(config: ModelConfig, i: int) -> WeightPlan:
    hf, ours = f"model.layers.{i}.self_attn.", f"layers.{i}."
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    plan = {
        ours + "input_norm": [
            _Piece(f"model.layers.{i}.input_layernorm.weight", config.hidden_size)
        ],
        ours + "qkv_proj.weight": _qkv_pieces(hf, "weight", q_rows, kv_rows),
        ours + "o_proj.weight": [_Piece(hf + "o_proj.weight", config.hidden_size)],
    }
    if config.attention_bias:
        plan[ours + "qkv_proj.bias"] = _qkv_pieces(hf, "bias", q_rows, kv_rows)
    if config.o_proj_bias:
        plan[ours + "o_proj.bias"] = [_Piece(hf + "o_proj.bias", config.hidden_size)]
    if config.qk_norm:
        plan[ours + "qk_norm"] = [
            _Piece(hf + "q_norm.weight", config.num_heads, broadcast=True),
            _Piece(hf + "k_norm.weight", config.num_kv_heads, broadcast=True),
        ]
    return plan


def _qkv_pieces(prefix: str, kind: str, q_rows: int, kv_rows: int) -> list[_Piece]:
    return [
        _Piece(f"{prefix}q_proj.{kind}", q_rows),
        _Piece(f"{prefix}k_proj.{kind}", kv_rows),
        _Piece(f"{prefix}v_proj.{kind}", kv_rows),
    ]


def _mlp_plan(config: ModelConfig, i: int) -> WeightPlan:
    hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}."
    inter, hidden = config.intermediate_size, config.hidden_size
    norm = f"model.layers.{i}.post_attention_layernorm.weight"
    plan = {
        ours + "post_attn_norm": [_Piece(norm, hidden)],
        ours + "gate_up_proj.weight": [
            _Piece(hf + "gate_proj.weight", inter),
            _Piece(hf + "up_proj.weight", inter),
        ],
        ours + "down_proj.weight": [_Piece(hf + "down_proj.weight", hidden)],
    }
    if config.mlp_bias:
        plan[ours + "gate_up_proj.bias"] = [
            _Piece(hf + "gate_proj.bias", inter),
            _Piece(hf + "up_proj.bias", inter),
        ]
        plan[ours + "down_proj.bias"] = [_Piece(hf + "down_proj.bias", hidden)]
    return plan


@dataclass(frozen=True)
class _Rows:
    """A checkpoint tensor not read yet: its shape, and its rows read a chunk at a time."""

    handle: Any  # SafetensorsShard or GgufTensors
    name: str
    shape: tuple[int, ...]

    def copy_into(self, dest: Tensor, broadcast: bool) -> None:
        """dest (the model's dtype and device) <- this tensor, at most CHUNK_BYTES (counted in
        float32) at a time; broadcast: a [D] vector repeated over dest's rows (q/k norm)."""
        max_rows = max(1, CHUNK_BYTES // (4 * max(1, math.prod(dest.shape[1:]))))
        for first, rows in self.handle.chunks(self.name, max_rows):
            target = dest if broadcast else dest[first : first + rows.shape[0]]
            target.copy_(rows)  # converts on the host first when dtypes differ: one chunk's worth
            del rows  # a view of the shard's map: its pages go with the last such view and the handle


class SafetensorsShard:
    """One shard's tensors by name, read as row ranges through safetensors' `safe_open`.

    A handle maps the whole file, its tensors are views of the map, and every page a read
    touched stays resident until the handle and the last of those views are gone: one handle
    over a bf16 load onto the CPU peaked at the model plus the whole file (2.0x the checkpoint,
    measured). So a handle serves at most MAP_BYTES of the file and is then dropped and the file
    reopened (a header read, ~0.3 ms for a 272-tensor shard; one per MAP_BYTES read, or per
    chunk of a tensor bigger than that): the host holds about MAP_BYTES of the file at a time.
    """

    def __init__(self, path: Path):
        self.path = path
        with self._open() as handle:
            self.entries = {name: _dtype_and_shape(handle, name) for name in handle.keys()}
        self._handle: Any = None  # the open safe_open, or None
        self._served = 0  # bytes read through it

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """ValueError, naming the file, for a dtype the loader does not read."""
        dtype, shape = self.entries[name]
        if dtype not in _ITEMSIZES:
            raise ValueError(f"{self.path}: tensor {name} has dtype {dtype}, which the loader does not read "
                             f"(one of {', '.join(_ITEMSIZES)})")
        return shape

    def chunks(self, name: str, max_rows: int) -> Iterator[tuple[int, Tensor]]:
        """(first row, [<= max_rows, *shape[1:]]) over the tensor's leading dimension (a 0-d
        or 1-d tensor comes whole); each is a view of the map, to copy and drop."""
        shape = self.shape(name)
        row_bytes = _ITEMSIZES[self.entries[name][0]] * math.prod(shape[1:])
        if len(shape) <= 1 or 0 in shape:
            yield 0, self._read(name, None, row_bytes * (shape[0] if shape else 1))
            return
        for first in range(0, shape[0], max_rows):
            stop = min(first + max_rows, shape[0])
            yield first, self._read(name, slice(first, stop), row_bytes * (stop - first))

    def close(self) -> None:
        self._handle = None  # unmapped once the last view read through it goes too

    def _read(self, name: str, rows: slice | None, nbytes: int) -> Tensor:
        """The tensor's `rows` (None: all of it), through a handle that has served at most
        MAP_BYTES before it; ValueError naming the file and tensor if safetensors fails."""
        if self._handle is None or self._served + nbytes > MAP_BYTES:
            self._handle, self._served = None, 0  # drop the old map before mapping again
            self._handle = self._open()
        self._served += nbytes
        try:
            tensor: Tensor = (self._handle.get_tensor(name) if rows is None
                              else self._handle.get_slice(name)[rows])
        except (SafetensorError, RuntimeError) as error:
            raise ValueError(f"{self.path}: cannot read tensor {name}: {error}") from error
        return tensor

    def _open(self) -> Any:
        try:
            return safe_open(str(self.path), framework="pt")
        except SafetensorError as error:
            raise ValueError(f"{self.path} is not a readable safetensors file: {error}") from error


def _dtype_and_shape(handle: Any, name: str) -> tuple[str, tuple[int, ...]]:
    info = handle.get_slice(name)  # reads no data
    return info.get_dtype(), tuple(info.get_shape())


class _Source:
    """Checkpoint tensors first, fallback tensors for names the checkpoint lacks."""

    def __init__(self, tensors: dict[str, Any], fallback: dict[str, Tensor]):
        self.tensors, self.fallback = tensors, fallback  # tensors: name -> SafetensorsShard or GgufTensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.fallback

    def get(self, name: str) -> Tensor | QuantizedMatrix | _Rows:
        """A fallback tensor; a GGUF's blocks where the model keeps them; else the rows to read."""
        handle = self.tensors.get(name)
        if handle is None:
            return self.fallback[name]
        blocks = handle.blocks(name) if isinstance(handle, GgufTensors) else None
        return _Rows(handle, name, tuple(handle.shape(name))) if blocks is None else blocks


@contextmanager
def _open_checkpoint(model_dir: Path) -> Iterator[dict[str, Any]]:
    """Yield tensor name -> its shard's SafetensorsShard, over every shard."""
    with ExitStack() as stack:
        index: dict[str, Any] = {}
        for path in _shard_files(model_dir):
            shard = SafetensorsShard(path)
            stack.callback(shard.close)
            index.update(dict.fromkeys(shard.keys(), shard))
        yield index


@contextmanager
def _gguf_checkpoint(tensors: GgufTensors) -> Iterator[dict[str, Any]]:
    """Yield tensor name -> the GGUF's tensors (the reader closes with the last reference)."""
    yield dict.fromkeys(tensors.keys(), tensors)


def _shard_files(model_dir: Path) -> list[Path]:
    # Prefer the index: some repos also ship non-HF files (e.g. consolidated.safetensors).
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _check_complete(plan: WeightPlan, source: _Source) -> None:
    missing = [p.hf_name for pieces in plan.values() for p in pieces if p.hf_name not in source]
    if missing:
        shown = ", ".join(missing[:20]) + (
            f" (+{len(missing) - 20} more)" if len(missing) > 20 else ""
        )
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {shown}")


def _shareable_fallback(param: Tensor, pieces: list[_Piece], source: _Source) -> Tensor | None:
    """The fallback tensor that can stand in for param as is, if there is one."""
    if len(pieces) != 1 or pieces[0].hf_name in source.tensors:
        return None
    tensor = source.fallback[pieces[0].hf_name]
    same = (tensor.shape, tensor.dtype, tensor.device) == (param.shape, param.dtype, param.device)
    return tensor if same else None


def _replace_parameter(model: LlamaForCausalLM, name: str, tensor: Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))  # shares storage


def _fill(param: Tensor, pieces: list[_Piece], source: _Source, float_headers: bool) -> QuantizedTensor | None:
    """Copy each piece into its row slice of param (converting dtype/device); or, where
    the pieces are GGUF blocks, return the QuantizedTensor of them to take param's place
    (float_headers: kernels/linear_quant.pack)."""
    start, blocks = 0, []
    for piece in pieces:
        dest = param[start : start + piece.rows]
        tensor = source.get(piece.hf_name)
        expected, got = tuple(dest.shape[1:] if piece.broadcast else dest.shape), tuple(tensor.shape)
        if got != expected:
            raise ValueError(f"weight {piece.hf_name} has shape {got}, expected {expected}")
        if isinstance(tensor, QuantizedMatrix):
            blocks.append(tensor)
        elif isinstance(tensor, _Rows):
            tensor.copy_into(dest, piece.broadcast)
        else:
            dest.copy_(tensor)  # a fallback tensor; broadcasts a [D] norm vector over its heads
        start += piece.rows
    if blocks and len(blocks) != len(pieces):
        raise ValueError(f"weights {[p.hf_name for p in pieces]} mix GGUF blocks and float tensors in one projection")
    return QuantizedTensor(blocks, float_headers) if blocks else None


def _warn_unused(tensors: dict[str, Any], plan: WeightPlan, config: ModelConfig) -> None:
    used = {p.hf_name for pieces in plan.values() for p in pieces}
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store a copy
    unused = [n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
    if unused:
        logger.warning("ignoring %d checkpoint tensor(s): %s", len(unused), ", ".join(unused[:10]))
