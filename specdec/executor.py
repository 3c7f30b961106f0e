"""The executor: the one object that runs the target's forward, chosen when the engine is
built and held by its ModelRunner. The model class does not know which one runs it.

- `PythonLayers`: the model's own layer code, op by op from Python over its attention and
  linear backends; the reference the others are tested against.
- `CppLayerLoop`: the embedding, every layer and the final norm in one C++ call
  (kernels/decoder_cpu.py) calling the same kernels, on the CPU where the cpp attention
  backend and C++ linears run the model. Driven from Python, a decode step of the default
  model spends as long dispatching its few hundred small ops as multiplying.
- `CudaGraphs` (specdec/cuda_graphs.py): graphs of the Python layers captured per step
  shape and replayed on CUDA.

Any executor can also capture EAGLE-3's target features (`capture_features`, set once when
the drafter is built): the residual stream entering a few chosen layers, for every query
row of every step, returned beside the logits (`ForwardOutput.features`).

`choose_executor` picks between the first two. Repacking the projections goes through the
executor (`use_linear_backend`, `install_linears`): the C++ loop holds pointers into the
packings and rebuilds its state when told, instead of rechecking them every step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from specdec.kernels import AttentionMetadata, PagedKV, attention_cpu, decoder_cpu
from specdec.kernels.attention_cpu import CppAttention
from specdec.kernels.linear_base import LinearBackend
from specdec.model_runner import ForwardOutput, StepInputs, upload
from specdec.models import LlamaForCausalLM
from specdec.models.linear import PackedWeights, install_linears, pack_linears


class Executor(ABC):
    """Runs `model`'s forward: over given tensors (`forward`) or one engine step (`run`)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.feature_layers: tuple[int, ...] = ()  # target layers whose input `run` captures

    @abstractmethod
    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        kv_caches: list[PagedKV],  # one per layer
        meta: AttentionMetadata,
        features: Tensor | None = None,  # [T, len(feature_layers) * H], written when given
    ) -> Tensor:  # [T, hidden], after the final norm
        """LlamaForCausalLM.forward's result, computed this executor's way; `features`
        gets the residual stream entering each of `feature_layers`, side by side."""

    def capture_features(self, layer_ids: Sequence[int]) -> None:
        """From now on every `run` also returns, for every query row, the residual stream
        entering each of these target layers (ForwardOutput.features, [T, len * H] in this
        order): the features EAGLE-3 heads draft from. Set once, when the drafter is built."""
        num_layers = len(self.model.layers)
        if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
            raise ValueError(f"feature layer ids {list(layer_ids)} must be layers of the target's "
                             f"{num_layers} (0 to {num_layers - 1})")
        self.feature_layers = tuple(layer_ids)

    def feature_buffer(self, num_tokens: int, device: torch.device) -> Tensor | None:  # [T, n * H] or None
        """An uninitialised buffer for a forward's features, or None without capture."""
        if not self.feature_layers:
            return None
        width = len(self.feature_layers) * self.model.config.hidden_size
        return torch.empty(num_tokens, width, dtype=self.model.dtype, device=device)

    def run(self, inputs: StepInputs, kv_caches: list[PagedKV], device: torch.device) -> ForwardOutput:
        """One step: its inputs uploaded to `device`, the forward over `kv_caches`, and the
        logits of the rows that need them (and every row's features when captured)."""
        input_ids, positions, meta, logit_rows = upload(inputs, device)
        features = self.feature_buffer(input_ids.shape[0], device)
        hidden = self.forward(input_ids, positions, kv_caches, meta, features)  # [T, H]
        hidden = hidden[logit_rows] if logit_rows.shape[0] < hidden.shape[0] else hidden
        return ForwardOutput(self.model.compute_logits(hidden), hidden, inputs.num_rows, features)

    def _capture(self, features: Tensor | None) -> tuple[Sequence[int], Tensor] | None:
        return None if features is None else (self.feature_layers, features)

    def use_linear_backend(self, backend: LinearBackend) -> None:
        """Repack every projection and the LM head for `backend` (see
        LlamaForCausalLM.use_linear_backend) and run on them from now on."""
        self.install_linears(pack_linears(self.model, backend))

    def install_linears(self, weights: PackedWeights) -> None:
        """Make the model's projections use `weights` (pack_linears of this model) and run
        on them from now on. Also the call to make after replacing the embedding table,
        which the C++ loop reads too."""
        install_linears(self.model, weights)


class PythonLayers(Executor):
    """The model's own layers, run from Python over its backends."""

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[PagedKV],
                meta: AttentionMetadata, features: Tensor | None = None) -> Tensor:
        return self.model(input_ids, positions, kv_caches, meta, self._capture(features))


class CppLayerLoop(Executor):
    """The model's layers in one C++ call (kernels/decoder_cpu.py). For a model on the cpp
    attention backend (`choose_executor` checks); `layers` is None while the projections'
    packings (or the model) are ones the loop cannot run, and every forward, like one over
    a cache the loop cannot read, then runs the Python layers, the loop's reference."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__(model)
        self.layers = build_layer_loop(model)

    def install_linears(self, weights: PackedWeights) -> None:
        super().install_linears(weights)
        self.layers = build_layer_loop(self.model)  # the old loop points into the old packings

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[PagedKV],
                meta: AttentionMetadata, features: Tensor | None = None) -> Tensor:
        kv = kv_caches[0]
        if self.layers is None or not decoder_cpu.supports_cache(kv):
            return self.model(input_ids, positions, kv_caches, meta, self._capture(features))
        model = self.model
        # The rows the cpp attention backend's plan would give its kernel, for every layer.
        rows = attention_cpu.plan_rows(meta, kv.k.shape[2])
        return self.layers.run(input_ids, positions, model.rope_cos, model.rope_sin, kv_caches, meta.slot_mapping,
                               rows, model.config.head_dim**-0.5,
                               self._capture(features))  # the embedding and the final norm included


def build_layer_loop(model: LlamaForCausalLM) -> decoder_cpu.DecoderLayers | None:
    """The C++ loop over the model's current weights and packings, or None where it cannot
    run them: a model not in float32, a q/k norm (Qwen3), an embedding table or a
    projection's packing the loop does not read, or kernels that do not build here."""
    layers = model.layers
    if (model.dtype != torch.float32 or layers[0].qk_norm is not None or not decoder_cpu.builds()
            or not decoder_cpu.runs_embedding(model.embed_tokens)):
        return None
    weights = [decoder_cpu.LayerWeights(layer.input_norm, layer.post_attn_norm, tuple(
        (linear.backend, linear.packed) for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                       layer.down_proj))) for layer in layers]
    if not all(decoder_cpu.runs_projection(*pair) for layer in weights for pair in layer.projections):
        return None
    c = model.config
    shape = decoder_cpu.Shape(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                              c.rms_norm_eps)
    return decoder_cpu.DecoderLayers(shape, model.embed_tokens, weights, model.norm)


def choose_executor(model: LlamaForCausalLM, kv_caches: list[PagedKV]) -> Executor:
    """The C++ layer loop where it runs `model` over `kv_caches` (the cpp attention backend
    reading them, and see build_layer_loop), else the Python layers."""
    if isinstance(model.attention_backend, CppAttention) and decoder_cpu.supports_cache(kv_caches[0]):
        loop = CppLayerLoop(model)
        if loop.layers is not None:
            return loop
    return PythonLayers(model)
