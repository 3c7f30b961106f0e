"""CUDA graphs for decode and verify steps: the target's forward captured once per batch
shape, then replayed, so a step costs one graph launch instead of a few hundred kernel
launches (what bounds small-batch decoding on a GPU).

A captured shape is B requests of Q query tokens each (`GraphShape`): Q = 1 for decode,
1 + the speculative lookahead for verify steps. A step fits a shape when it has at most B
requests of at most Q query tokens; it is padded to it (`pad_inputs`): each request's
query gets dummy tokens after its own, and dummy requests fill the batch. Dummy tokens
have slot -1, which the Triton store skips, so they write no KV; each request's context
length grows by its padding, so its real tokens see exactly the keys they see unpadded,
and its padding rows (whose results are dropped) see what follows. The Triton backend is
the one that captures: its plan derives everything from device tensors.

A decode shape's graph also runs the LM head and samples every row
(specdec/graph_sampling.py): under overlap scheduling, a decode step is then one launch
whose output is its sampled tokens. Verify shapes stop at the final norm; their logits
are computed after the replay, on the rows that need them.

Steps that fit no shape (prefill chunks, anything larger) run eagerly. The choice of
shapes and the padding are plain host code, tested on the CPU; capture and replay need a
GPU (`cuda`-marked tests).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from specdec.config import EngineConfig
from specdec.executor import Executor, choose_executor
from specdec.graph_sampling import GraphSampler, GraphTokens, RootSampling
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata
from specdec.model_runner import (
    ForwardOutput,
    KVCache,
    ModelRunner,
    StepInputs,
    feed_tokens,
    stack_masks,
    to_device,
)
from specdec.models import LlamaForCausalLM
from specdec.models.linear import PackedWeights

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE


@dataclass(frozen=True, order=True)
class GraphShape:
    batch_size: int  # requests, dummy ones included
    query_len: int  # query tokens of every request, dummy ones included
    masked: bool  # rows read a tree mask (else causal among the query tokens)

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.query_len

    @property
    def decodes(self) -> bool:
        """A decode shape (one query token a request): its graph samples too."""
        return self.query_len == 1


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below max_num_seqs, then max_num_seqs: a batch
    pads to the next size, so past 8 at most 7 dummy requests run (vLLM's choice)."""
    small = [size for size in (1, 2, 4) if size < max_num_seqs]
    return small + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


def graph_shapes(config: EngineConfig) -> list[GraphShape]:
    """The shapes captured for `config`, smallest first: decode (Q = 1, causal) and, with
    speculation, verify (Q = 1 + the lookahead, masked when the drafter builds trees)."""
    spec = config.speculative_config
    sizes = graph_batch_sizes(config.max_num_seqs)
    shapes = [GraphShape(size, 1, False) for size in sizes]
    if spec is not None:
        shapes += [GraphShape(size, 1 + spec.num_lookahead_slots, spec.num_tree_nodes > 0) for size in sizes]
    return sorted(shapes, key=lambda s: (s.num_tokens, s.masked))


def choose_shape(inputs: StepInputs, shapes: list[GraphShape]) -> GraphShape | None:
    """The smallest shape the step fits, or None (it runs eagerly)."""
    batch_size, query_len = len(inputs.query_lens), max(inputs.query_lens, default=0)
    for shape in shapes:  # smallest first
        fits = shape.batch_size >= batch_size and shape.query_len >= query_len
        if fits and (shape.masked or inputs.masks is None):
            return shape
    return None


def pad_inputs(inputs: StepInputs, shape: GraphShape, block_size: int) -> StepInputs:
    """The step laid out as `shape`: request b's query at rows [b*Q, b*Q + q_b), dummy
    tokens after it, dummy requests (no tokens of their own) after the real ones; see the
    module docstring."""
    padded = StepInputs([], [], [], [shape.query_len] * shape.batch_size, [], [], [],
                        [] if shape.masked else None, [])
    start, padded_row = 0, dict[int, int]()  # flat row -> padded row
    for b, q_len in enumerate(inputs.query_lens):
        end = start + q_len
        mask = inputs.masks[b] if inputs.masks is not None else torch.ones(q_len, q_len, dtype=torch.bool).tril()
        _add_request(padded, shape.query_len, block_size, inputs.token_ids[start:end], inputs.positions[start:end],
                     inputs.slots[start:end], inputs.seq_lens[b], inputs.block_tables[b], inputs.num_rows[b], mask)
        padded_row.update((start + j, b * shape.query_len + j) for j in range(q_len))
        start = end
    for _ in range(shape.batch_size - len(inputs.query_lens)):
        _add_request(padded, shape.query_len, block_size, [], [], [], 0, [], 0, torch.zeros(0, 0, dtype=torch.bool))
    padded.fed_rows = [padded_row[row] for row in inputs.fed_rows]  # overlap scheduling's device-side roots
    padded.fed_tokens = inputs.fed_tokens
    return padded


def _add_request(padded: StepInputs, query_len: int, block_size: int, token_ids: list[int], positions: list[int],
                 slots: list[int], seq_len: int, table: list[int], num_rows: int,
                 mask: torch.Tensor) -> None:  # mask: [q, q] bool over the request's own tokens
    """Append one request, its query padded to query_len. Its block table is lengthened
    with block 0 to cover the padded context: padding rows read whatever is there, within
    bounds."""
    pad, row = query_len - len(token_ids), len(padded.seq_lens) * query_len
    padded.token_ids += token_ids + [0] * pad
    padded.positions += positions + [0] * pad
    padded.slots += slots + [-1] * pad
    padded.seq_lens.append(seq_len + pad)
    padded.block_tables.append(table + [0] * max(0, -(-(seq_len + pad) // block_size) - len(table)))
    padded.num_rows.append(num_rows)
    padded.logit_rows += range(row + len(token_ids) - num_rows, row + len(token_ids))
    if padded.masks is not None:
        padded.masks.append(_pad_mask(mask, query_len))


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:  # [q, q] bool -> [width, width] bool
    """The request's mask, its dummy tokens seeing themselves alone (and no real token
    seeing them)."""
    out = torch.eye(width, dtype=torch.bool)
    out[: len(mask), : len(mask)] = mask
    return out


class StaticInputs:
    """The device buffers every graph reads its inputs from, sized for the largest shape;
    a shape's graph reads their leading parts."""

    def __init__(self, shapes: list[GraphShape], table_width: int, device: torch.device) -> None:
        max_tokens = max(s.num_tokens for s in shapes)
        max_batch = max(s.batch_size for s in shapes)
        longs = lambda *size: torch.zeros(*size, dtype=torch.int64, device=device)  # noqa: E731
        self.token_ids, self.positions, self.slots = longs(max_tokens), longs(max_tokens), longs(max_tokens)
        self.query_start_loc = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, table_width, dtype=torch.int32, device=device)
        # One mask buffer per masked query length, so a shape's mask is a contiguous prefix.
        self.masks = {s.query_len: torch.zeros(max_batch * s.query_len, s.query_len, dtype=torch.bool, device=device)
                      for s in shapes if s.masked}

    def metadata(self, shape: GraphShape) -> AttentionMetadata:
        """The views a graph of `shape` is captured on."""
        b, t = shape.batch_size, shape.num_tokens
        return AttentionMetadata(
            slot_mapping=self.slots[:t], query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], query_lens_cpu=[shape.query_len] * b,
            seq_lens_cpu=[shape.query_len] * b,
            tree_mask=self.masks[shape.query_len][:t] if shape.masked else None)

    def fill(self, padded: StepInputs, shape: GraphShape) -> None:
        """Copy a padded step in; the copies queue behind the GPU's work (no sync). Roots
        that are on the device only (overlap scheduling) are scattered in after the ids."""
        b, t, width = shape.batch_size, shape.num_tokens, self.block_tables.shape[1]
        for buffer, values in ((self.token_ids, padded.token_ids), (self.positions, padded.positions),
                               (self.slots, padded.slots)):
            buffer[:t].copy_(torch.tensor(values, dtype=torch.int64), non_blocking=True)
        feed_tokens(self.token_ids, padded.fed_rows, padded.fed_tokens)
        starts = [shape.query_len * i for i in range(b + 1)]
        self.query_start_loc[: b + 1].copy_(torch.tensor(starts, dtype=torch.int32), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor(padded.seq_lens, dtype=torch.int32), non_blocking=True)
        tables = torch.zeros(b, width, dtype=torch.int32)
        for row, table in enumerate(padded.block_tables):
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.block_tables[:b].copy_(tables, non_blocking=True)
        if padded.masks is not None:
            self.masks[shape.query_len][:t].copy_(stack_masks(padded.masks, shape.query_len), non_blocking=True)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [num_tokens, H] the graph's output buffer


@dataclass
class DecodeOutputs:
    """A decode graph's logits and tokens: the tensors the last run of its forward made.
    The captured run is the last on a GPU, so they are the graph's own, refilled by every
    replay (as CapturedStep.hidden); a CPU stand-in that reruns the forward updates them."""

    logits: torch.Tensor | None = None  # [B, V] float32
    tokens: torch.Tensor | None = None  # [B] int64, NO_TOKEN where the graph decides nothing


Out = TypeVar("Out")


def record(forward: Callable[[], Out], pool: _POOL_HANDLE, device: torch.device) -> tuple[torch.cuda.CUDAGraph, Out]:
    """`forward` run once off the capture (Triton compiles, cuBLAS picks its kernels),
    then captured: the graph, and the buffers its replays refill."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = forward()
    return graph, outputs


def capture_graph(forward: Callable[[], torch.Tensor], pool: _POOL_HANDLE, device: torch.device) -> CapturedStep:
    """A step's forward captured; replaying the graph refills the returned buffer."""
    return CapturedStep(*record(forward, pool, device))


class CudaGraphs(Executor):
    """The executor on CUDA: replays a captured graph of `eager`'s forward for every step
    fitting a graph shape, and leaves the other steps, and forwards over other tensors
    (calibration, profiling), to `eager`. CUDA and the triton attention backend only."""

    def __init__(self, eager: Executor, config: EngineConfig, kv_cache: KVCache, device: torch.device,
                 max_model_len: int) -> None:
        super().__init__(eager.model)
        self.eager = eager
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = config.block_size
        self.shapes = graph_shapes(config)
        # Wide enough for a request at max_model_len plus its lookahead and its padding.
        longest = max_model_len + 2 * max(s.query_len for s in self.shapes)
        self.static = StaticInputs(self.shapes, -(-longest // config.block_size), device)
        self.captured: dict[GraphShape, CapturedStep] = {}
        self.decoded = {shape: DecodeOutputs() for shape in self.shapes if shape.decodes}
        self.sampler = GraphSampler(max(s.batch_size for s in self.decoded), self.model.config.vocab_size, device,
                                    use_triton=self.model.attention_backend.name == "triton")
        self.features: torch.Tensor | None = None  # [max tokens, n * H] the graphs' feature buffer, once captured
        self.capture()

    def capture_features(self, layer_ids: Sequence[int]) -> None:
        """Capture features in the graphs too (into one static buffer) and in eager steps:
        the graphs are captured again."""
        super().capture_features(layer_ids)
        self.eager.capture_features(layer_ids)
        self.features = self.feature_buffer(max(s.num_tokens for s in self.shapes), self.device)
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape on dummy requests (they write no KV), largest first, all
        in one memory pool: graphs replay one at a time, so they share their activations."""
        pool = torch.cuda.graph_pool_handle()
        for shape in reversed(self.shapes):
            empty = StepInputs([], [], [], [], [], [], [], None, [])
            self.static.fill(pad_inputs(empty, shape, self.block_size), shape)
            self.captured[shape] = capture_graph(self._forward(shape), pool, self.device)

    def _forward(self, shape: GraphShape) -> Callable[[], torch.Tensor]:  # () -> [num_tokens, H]
        """The target's forward of a `shape` step on the static buffers; for a decode
        shape also its logits and sampled tokens, kept in self.decoded[shape]."""
        t = shape.num_tokens
        meta = self.static.metadata(shape)
        features = None if self.features is None else self.features[:t]

        def forward() -> torch.Tensor:  # [num_tokens, H]
            hidden = self.eager.forward(self.static.token_ids[:t], self.static.positions[:t], self.kv_cache.layers,
                                        meta, features)
            if shape.decodes:
                outputs = self.decoded[shape]
                outputs.logits = self.model.compute_logits(hidden)  # [B, V]
                outputs.tokens = self.sampler.sample(outputs.logits)  # [B]
            return hidden

        return forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[PagedKV],
                meta: AttentionMetadata, features: torch.Tensor | None = None) -> torch.Tensor:
        return self.eager.forward(input_ids, positions, kv_caches, meta, features)

    def run(self, inputs: StepInputs, kv_caches: list[PagedKV], device: torch.device) -> ForwardOutput:
        shape = choose_shape(inputs, self.shapes)
        if shape is None or kv_caches is not self.kv_cache.layers:  # the graphs read the cache they were captured on
            return self.eager.run(inputs, kv_caches, device)
        padded = pad_inputs(inputs, shape, self.block_size)
        self.static.fill(padded, shape)
        # Features are committed with their step (no overlap), so such steps sample on the host.
        sampling = inputs.sampling if shape.decodes and self.features is None else None
        if sampling is not None:
            self.sampler.fill(sampling, shape.batch_size)
        step = self.captured[shape]
        step.graph.replay()
        # Gathered into new tensors: the next replay overwrites the graph's buffers.
        rows = to_device(padded.logit_rows, torch.int64, device)
        hidden = step.hidden[rows]  # [R, H]
        if not shape.decodes:
            logits = self.model.compute_logits(hidden)  # [R, V]
        else:  # request b's row is row b
            logits = self._decoded(shape)[0][rows]  # [R, V]
        return ForwardOutput(logits, hidden, inputs.num_rows, self._unpadded_features(inputs, shape),
                             self._sampled(shape, sampling, len(inputs.query_lens)))

    def _decoded(self, shape: GraphShape) -> tuple[torch.Tensor, torch.Tensor]:  # [B, V] logits, [B] tokens
        outputs = self.decoded[shape]
        assert outputs.logits is not None and outputs.tokens is not None, f"{shape} was not captured"
        return outputs.logits, outputs.tokens

    def _sampled(self, shape: GraphShape, sampling: RootSampling | None, batch_size: int) -> GraphTokens | None:
        """The replayed step's tokens, per real request, copied out of the graph's buffer."""
        if sampling is None:
            return None
        return GraphTokens(self._decoded(shape)[1][:batch_size].clone(), sampling.rows)

    def _unpadded_features(self, inputs: StepInputs, shape: GraphShape) -> torch.Tensor | None:  # [T, n * H]
        """The replayed step's features of the real query rows, in batch order (request b's
        rows start at b * Q in the padded layout), gathered into a new tensor."""
        if self.features is None:
            return None
        rows = [b * shape.query_len + j for b, q_len in enumerate(inputs.query_lens) for j in range(q_len)]
        return self.features[to_device(rows, torch.int64, self.device)]

    def install_linears(self, weights: PackedWeights) -> None:
        self.eager.install_linears(weights)
        self.capture()  # the graphs replay the kernels on the packings they were captured with


def make_runner(model: LlamaForCausalLM, config: EngineConfig, kv_cache: KVCache, device: torch.device,
                max_model_len: int) -> ModelRunner:
    """The target's runner and its executor: CUDA graphs over the eager executor on CUDA
    unless enforce_eager, else choose_executor's."""
    executor = choose_executor(model, kv_cache.layers)
    if device.type == "cuda" and not config.enforce_eager:
        executor = CudaGraphs(executor, config, kv_cache, device, max_model_len)
    return ModelRunner(executor, config, kv_cache, device)
