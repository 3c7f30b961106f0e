"""The C++ layer loop (kernels/decoder_cpu.py, run by the CppLayerLoop executor) against the
model's Python layer code, its reference: the same logits for prefill, decode and
tree-verify steps, row invariance (what lossless speculation relies on), and the cases it
leaves to Python."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from specdec.executor import CppLayerLoop, Executor, PythonLayers, choose_executor
from specdec.kernels import PagedKV, decoder_cpu
from specdec.kernels.attention import make_attention_backend
from specdec.kernels.gguf_blocks import quantize
from specdec.kernels.linear import Fp32Linear, get_linear_backend
from specdec.kernels.linear_gguf import GgufLinear
from specdec.kernels.quantized_tensor import QuantizedTensor
from specdec.llm import LLM
from specdec.models import LlamaForCausalLM, load_model
from specdec.models.linear import install_linears, pack_linears
from tests.fixtures import make_checkpoint
from tests.helpers import (
    NGRAM,
    assert_all_blocks_free,
    block_bytes,
    greedy,
    make_kv_caches,
    random_block_table,
    random_prompts,
    single_request_meta,
    step_mixed,
    token_ids,
)

pytestmark = pytest.mark.skipif(not decoder_cpu.builds(), reason="the C++ kernels do not build here")

# (linear backend, int8 activations): the backends whose projections the loop runs.
BACKENDS = [("cpp-fp16", False), ("q8_0", False), ("q4_1", False), ("q4_1", True)]
# Tree verify: node 0 the root, nodes 1-2 its children, node 3 a child of node 1.
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def d32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Head dim 32: one the C++ attention is built for (the shared tiny model's 16 is not).
    return make_checkpoint(tmp_path_factory.mktemp("tiny-d32"), head_dim=32)


@pytest.fixture(scope="module")
def model(d32_dir: Path) -> LlamaForCausalLM:
    return load_model(d32_dir, attention_backend="cpp")


def _use(model: LlamaForCausalLM, name: str, int8: bool) -> None:
    backend = get_linear_backend(name)
    if int8:
        backend = type(backend)(activations="int8")  # type: ignore[call-arg]
    model.use_linear_backend(backend)


def _caches(model: LlamaForCausalLM) -> list[PagedKV]:
    c = model.config
    return make_kv_caches(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim, fill=float("nan"))


def _steps(executor: Executor, ids: Tensor) -> Tensor:
    """Logits of a 9-token prefill, a 1-token decode and a 4-node tree verify."""
    caches = _caches(executor.model)
    table = random_block_table(len(ids), 4, 8, seed=3)
    out = []
    with torch.inference_mode():
        for start, count, mask in ((0, 9, None), (9, 1, None), (10, 4, TREE)):
            meta = single_request_meta(start, count, table, 4, tree_mask=mask)
            depth = torch.arange(count) if mask is None else mask.sum(1) - 1
            hidden = executor.forward(ids[start : start + count], start + depth, caches, meta)
            out.append(executor.model.compute_logits(hidden))
    return torch.cat(out)


def _assert_the_loop_matches_python(model: LlamaForCausalLM, ids: Tensor) -> None:
    """The loop's logits (it must run) against the Python layers' on the same steps."""
    loop = choose_executor(model, _caches(model))
    assert isinstance(loop, CppLayerLoop) and isinstance(loop.layers, decoder_cpu.DecoderLayers)
    expected = _steps(PythonLayers(model), ids)
    got = _steps(loop, ids)
    # RoPE, SiLU and the adds are the loop's own float32 arithmetic: equal up to rounding.
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("name,int8", BACKENDS)
def test_the_loop_gives_the_python_layers_logits(model: LlamaForCausalLM, name: str, int8: bool) -> None:
    ids = torch.randint(3, model.config.vocab_size, (14,), generator=torch.Generator().manual_seed(1))
    try:
        _use(model, name, int8)
        _assert_the_loop_matches_python(model, ids)
    finally:
        model.use_linear_backend(Fp32Linear())


@pytest.mark.parametrize("name,int8", BACKENDS)
def test_each_row_gets_what_it_gets_alone(model: LlamaForCausalLM, name: str, int8: bool) -> None:
    """A prefill of 10 tokens gives its last row the bits of 9 tokens then a decode of 1."""
    ids = torch.randint(3, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(2))
    c = model.config
    try:
        _use(model, name, int8)
        loop = CppLayerLoop(model)
        assert isinstance(loop.layers, decoder_cpu.DecoderLayers)
        logits = []
        for chunks in (((0, 10),), ((0, 9), (9, 10))):
            caches = make_kv_caches(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim, fill=float("nan"))
            table = random_block_table(10, 4, 8, seed=5)
            with torch.inference_mode():
                for start, stop in chunks:
                    meta = single_request_meta(start, stop - start, table, 4)
                    hidden = loop.forward(ids[start:stop], torch.arange(start, stop), caches, meta)
            logits.append(model.compute_logits(hidden[-1:]))
        assert torch.equal(logits[0], logits[1])
    finally:
        model.use_linear_backend(Fp32Linear())


def test_an_empty_step_and_a_long_prefill_then_decode(model: LlamaForCausalLM) -> None:
    """No tokens: nothing to do (the kernels' row blocking would divide by zero); a prefill
    longer than the buffers kept between steps, then decodes, still match Python."""
    c = model.config
    ids = torch.randint(3, c.vocab_size, (140,), generator=torch.Generator().manual_seed(6))
    try:
        model.use_linear_backend(get_linear_backend("cpp-fp16"))
        loop = CppLayerLoop(model)
        with torch.inference_mode():
            caches = make_kv_caches(c.num_layers, 40, 4, c.num_kv_heads, c.head_dim)
            empty = loop.forward(ids[:0], torch.arange(0), caches, single_request_meta(0, 0, [0], 4))
            assert empty.shape == (0, c.hidden_size)
        logits = {}
        for executor in (loop, PythonLayers(model)):
            caches = make_kv_caches(c.num_layers, 40, 4, c.num_kv_heads, c.head_dim, fill=float("nan"))
            table = random_block_table(140, 4, 40, seed=7)
            with torch.inference_mode():
                prefill = single_request_meta(0, 138, table, 4)
                rows = [executor.forward(ids[:138], torch.arange(138), caches, prefill)[-1:]]
                for start in (138, 139):
                    meta = single_request_meta(start, 1, table, 4)
                    rows.append(executor.forward(ids[start : start + 1], torch.tensor([start]), caches, meta))
            logits[executor is loop] = model.compute_logits(torch.cat(rows))
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
    finally:
        model.use_linear_backend(Fp32Linear())


@pytest.fixture
def no_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any step that runs the loop."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the C++ layer loop ran")

    monkeypatch.setattr(decoder_cpu.DecoderLayers, "run", fail)


def test_backends_without_c_kernels_stay_in_python(model: LlamaForCausalLM, no_loop: None) -> None:
    ids = torch.randint(3, model.config.vocab_size, (14,), generator=torch.Generator().manual_seed(3))
    assert isinstance(choose_executor(model, _caches(model)), PythonLayers)  # fp32's F.linear has no C entry point
    loop = CppLayerLoop(model)
    try:
        loop.use_linear_backend(get_linear_backend("cpp-fp16"))
        assert loop.layers is not None
        loop.use_linear_backend(Fp32Linear())  # a repack the loop cannot run: its reference runs the steps
        assert loop.layers is None
        assert torch.equal(_steps(loop, ids), _steps(PythonLayers(model), ids))
    finally:
        model.use_linear_backend(Fp32Linear())


def test_qk_norm_models_stay_in_python(tmp_path: Path, no_loop: None) -> None:
    qwen3 = load_model(make_checkpoint(tmp_path / "qwen3", model_type="qwen3", head_dim=32), attention_backend="cpp")
    qwen3.use_linear_backend(get_linear_backend("cpp-fp16"))
    assert isinstance(choose_executor(qwen3, _caches(qwen3)), PythonLayers)
    assert CppLayerLoop(qwen3).layers is None


def test_the_torch_attention_backend_stays_in_python(model: LlamaForCausalLM, no_loop: None) -> None:
    attention = model.attention_backend
    try:
        model.use_linear_backend(get_linear_backend("cpp-fp16"))
        model.attention_backend = make_attention_backend("torch", "cpu")
        assert isinstance(choose_executor(model, _caches(model)), PythonLayers)
    finally:
        model.attention_backend = attention
        model.use_linear_backend(Fp32Linear())


def test_packings_installed_through_the_loop_are_the_ones_it_runs(model: LlamaForCausalLM) -> None:
    """What evals/bench_kernels.py does: pack once per backend, then install in turn; the
    loop rebuilds its pointers into the packings when they are installed through it."""
    ids = torch.randint(3, model.config.vocab_size, (14,), generator=torch.Generator().manual_seed(8))
    packings = {name: pack_linears(model, get_linear_backend(name)) for name in ("cpp-fp16", "q8_0")}
    try:
        expected = {}
        for name, packing in packings.items():
            install_linears(model, packing)
            expected[name] = _steps(PythonLayers(model), ids)
        loop = CppLayerLoop(model)
        for name in ("cpp-fp16", "q8_0", "cpp-fp16"):
            loop.install_linears(packings[name])
            torch.testing.assert_close(_steps(loop, ids), expected[name], rtol=1e-4, atol=1e-4)
    finally:
        model.use_linear_backend(Fp32Linear())


def test_a_slot_outside_the_cache_is_refused(model: LlamaForCausalLM) -> None:
    c = model.config
    caches = make_kv_caches(c.num_layers, 2, 4, c.num_kv_heads, c.head_dim)
    meta = single_request_meta(0, 3, [0], 4)
    meta.slot_mapping[1] = 99
    try:
        model.use_linear_backend(get_linear_backend("cpp-fp16"))
        with torch.inference_mode(), pytest.raises(IndexError, match="outside the cache's 8 slots"):
            CppLayerLoop(model).forward(torch.tensor([5, 6, 7]), torch.arange(3), caches, meta)
    finally:
        model.use_linear_backend(Fp32Linear())


def test_an_mlp_width_off_the_vector_width_takes_the_silu_tail(tmp_path: Path) -> None:
    """Intermediate size 100: SiLU's last 4 values go through its tail (8 or 16 lanes)."""
    odd = load_model(make_checkpoint(tmp_path, head_dim=32, intermediate_size=100), attention_backend="cpp")
    odd.use_linear_backend(get_linear_backend("cpp-fp16"))
    ids = torch.randint(3, odd.config.vocab_size, (14,), generator=torch.Generator().manual_seed(5))
    _assert_the_loop_matches_python(odd, ids)


def test_a_token_outside_the_embedding_is_refused(model: LlamaForCausalLM) -> None:
    c = model.config
    caches = make_kv_caches(c.num_layers, 2, 4, c.num_kv_heads, c.head_dim)
    try:
        model.use_linear_backend(get_linear_backend("cpp-fp16"))
        loop = CppLayerLoop(model)
        for bad in (c.vocab_size, -1):
            outside = f"outside the embedding's {c.vocab_size} rows"
            with torch.inference_mode(), pytest.raises(IndexError, match=outside):
                loop.forward(torch.tensor([5, bad, 7]), torch.arange(3), caches, single_request_meta(0, 3, [0], 4))
    finally:
        model.use_linear_backend(Fp32Linear())


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_a_quantized_embedding_table_is_looked_up_in_the_loop(model: LlamaForCausalLM, qtype: str) -> None:
    """A GGUF model's table stays in its blocks; the loop dequantizes the step's rows as
    torch's F.embedding does on it."""
    ids = torch.randint(3, model.config.vocab_size, (14,), generator=torch.Generator().manual_seed(4))
    table = model.embed_tokens
    try:
        model.embed_tokens = nn.Parameter(QuantizedTensor([quantize(table.detach(), qtype)]), requires_grad=False)
        model.use_linear_backend(get_linear_backend("cpp-fp16"))
        _assert_the_loop_matches_python(model, ids)
    finally:
        model.embed_tokens = table
        model.use_linear_backend(Fp32Linear())


def test_an_embedding_the_loop_cannot_read_stays_in_python() -> None:
    parts = [quantize(torch.randn(8, 64), "q8_0"), quantize(torch.randn(8, 64), "q4_1")]
    assert not decoder_cpu.runs_embedding(QuantizedTensor(parts))  # two block types: two segments
    assert decoder_cpu.runs_embedding(QuantizedTensor(parts[:1]))
    assert not decoder_cpu.runs_embedding(torch.randn(64, 8).t())  # not contiguous
    assert not decoder_cpu.runs_embedding(torch.randn(8, 64, dtype=torch.float16))


def test_mixed_segments_are_not_run_by_the_loop() -> None:
    backend = GgufLinear()
    weight = torch.randn(64, 64)
    assert decoder_cpu.runs_projection(backend, backend.prepare(weight))  # fp16 tiles
    assert not decoder_cpu.runs_projection(Fp32Linear(), Fp32Linear().prepare(weight))


SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "num_tree_nodes": 8, "suffix_min_prob": 0.0}


@pytest.mark.parametrize("quantization", ["none", "q4_1"])
@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_speculation_through_the_loop_is_lossless_batched_chunked_and_preempted(
        d32_dir: Path, quantization: str, spec: dict[str, object]) -> None:
    prompts = random_prompts(100, 6)
    plain = LLM(str(d32_dir), max_model_len=128, quantization=quantization, speculative_config=None)
    expected = token_ids(plain.generate(prompts, greedy()))
    llm = LLM(str(d32_dir), max_model_len=128, max_num_batched_tokens=24, quantization=quantization,
              kv_cache_memory=9 * block_bytes(plain), speculative_config=spec)
    assert token_ids(llm.generate(prompts, greedy())) == expected  # suffix decoding's cache now holds them
    assert step_mixed(llm.engine, prompts, greedy()) == expected
    for run in (plain, llm):
        executor = run.engine.runner.executor
        assert isinstance(executor, CppLayerLoop) and isinstance(executor.layers, decoder_cpu.DecoderLayers)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["num_drafts"] > 0
    assert_all_blocks_free(llm)
