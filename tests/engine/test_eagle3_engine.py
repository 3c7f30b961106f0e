"""EAGLE-3 through the whole engine: the target's features captured by every executor
(the Python layers, the C++ layer loop, CUDA graphs), the rows a step keeps handed to the
drafter, and greedy output identical to plain decoding, batched, with chunked prefill and
forced preemption, every KV block freed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.executor import CppLayerLoop, PythonLayers
from specdec.kernels import decoder_cpu
from specdec.llm import LLM
from specdec.model_runner import ForwardOutput, StepInputs
from specdec.request import Request
from specdec.sampling_params import SamplingParams
from specdec.scheduler import ScheduledRequest
from specdec.spec.tree import DraftTree
from specdec.spec.verify import verify
from tests.fixtures import make_checkpoint, make_eagle3_head
from tests.helpers import assert_all_blocks_free, block_bytes, greedy, random_prompts, step_mixed, token_ids

needs_the_loop = pytest.mark.skipif(not decoder_cpu.builds(), reason="the C++ kernels do not build here")
LAYERS = (0, 2, 3)  # low / middle / high of the 4-layer target below


@pytest.fixture(scope="module")
def d32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Head dim 32 (the C++ attention is built for it), 4 layers: three distinct feature layers.
    return make_checkpoint(tmp_path_factory.mktemp("eagle3-d32"), head_dim=32, num_layers=4)


@pytest.fixture(scope="module")
def d32_head(tmp_path_factory: pytest.TempPathFactory, d32_dir: Path) -> Path:
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3-d32-head"), d32_dir, aux_layer_ids=LAYERS)


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3-tiny-head"), tiny_model_dir)


def eagle3(head: Path, depth: int = 3, nodes: int = 8, **extra: object) -> dict[str, object]:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": depth, "num_tree_nodes": nodes,
            **extra}


def _prefill(ids: list[int]) -> StepInputs:
    n = len(ids)
    return StepInputs(ids, list(range(n)), list(range(n)), [n], [n], [[0]], [n], None, list(range(n)))


# ---- capture -----------------------------------------------------------------------------------


def test_captured_features_are_the_hf_hidden_states(d32_dir: Path) -> None:
    """Feature i is the residual stream entering target layer i: HF's hidden_states[i]."""
    import transformers

    llm = LLM(str(d32_dir), max_model_len=64, speculative_config=None, linear_backend="fp32",
              kv_cache_dtype="fp32")
    executor = llm.engine.runner.executor
    layers = (3, 0, 2, 2)  # any order, repeats allowed
    executor.capture_features(layers)
    ids = torch.randint(3, 384, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        out = executor.run(_prefill(ids), llm.engine.runner.kv_cache.layers, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d32_dir), dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert out.features is not None and out.features.shape == (12, 4 * 64)
    torch.testing.assert_close(out.features, torch.cat([states[i][0] for i in layers], -1), rtol=1e-4, atol=1e-4)


@needs_the_loop
def test_the_cpp_layer_loop_captures_what_the_python_layers_capture(d32_dir: Path) -> None:
    llm = LLM(str(d32_dir), max_model_len=64, speculative_config=None)
    loop = llm.engine.runner.executor
    assert isinstance(loop, CppLayerLoop) and loop.layers is not None
    python = PythonLayers(loop.model)
    features = []
    ids = torch.randint(3, 384, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    for executor in (loop, python):
        executor.capture_features(LAYERS)
        with torch.inference_mode():
            out = executor.run(_prefill(ids), llm.engine.runner.kv_cache.layers, torch.device("cpu"))
        features.append(out.features)
    assert features[0] is not None and features[1] is not None
    assert torch.equal(features[0][:, :64], features[1][:, :64])  # layer 0: the embedding, exactly
    # The loop rounds its RoPE, SiLU and residual adds its own way (hidden values ~20 here).
    torch.testing.assert_close(features[0], features[1], rtol=1e-4, atol=2e-3)


def test_no_capture_no_features(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=64, speculative_config=None)
    with torch.inference_mode():
        out = llm.engine.runner.executor.run(_prefill([5, 6, 7]), llm.engine.runner.kv_cache.layers,
                                             torch.device("cpu"))
    assert out.features is None
    with pytest.raises(ValueError, match="must be layers of the target's 2"):
        llm.engine.runner.executor.capture_features((0, 2))


def test_verify_keeps_the_features_of_the_kept_rows() -> None:
    """A prefill chunk keeps all its rows; a verify step its known tokens, root and accepted path."""
    params = SamplingParams(temperature=0.0)
    prefill = Request("a", [1, 2, 3, 4, 5], params, None, 8, set())
    verifying = Request("b", [1, 2, 3, 4], params, None, 8, set())
    verifying.num_computed_tokens = 2
    tree = DraftTree([4, 7, 8, 9, 6], [-1, 0, 0, 2, 3])  # root 4, then 8 -> 9 -> 6 on the second branch
    batch = [ScheduledRequest(prefill, 3), ScheduledRequest(verifying, 2, 4, 3)]
    trees = [DraftTree([3], [-1]), tree]
    rows = 3 + 1 + tree.num_nodes  # prefill's 3, then b's known token 3, root and nodes
    logits = torch.full((tree.num_nodes, 16), -10.0)
    for row, token in enumerate([8, 5, 9, 11, 12]):  # the root picks 8, node 2 picks 9, node 3 picks 11
        logits[row, token] = 10.0
    features = torch.arange(rows, dtype=torch.float32)[:, None].repeat(1, 6)  # row r holds r
    output = ForwardOutput(logits, torch.zeros(tree.num_nodes, 4), [0, tree.num_nodes], features)
    results = verify(batch, trees, output)
    assert results[1].tokens == [8, 9, 11] and results[1].accepted_nodes == [2, 3]
    assert results[0].features is not None and results[0].features[:, 0].tolist() == [0, 1, 2]
    assert results[0].features_start == 0
    # b: known token (row 3), root (row 4), nodes 2 and 3 (rows 6 and 7); node 1 and 4 rejected
    assert results[1].features is not None and results[1].features[:, 0].tolist() == [3, 4, 6, 7]
    assert results[1].features_start == 2


# ---- lossless through the engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=256, speculative_config=None)


def _check_drafter_empty(llm: LLM) -> None:
    drafter = llm.engine.drafter
    assert isinstance(drafter, Eagle3Drafter) and drafter.contexts == {}
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks


@pytest.mark.parametrize("shape", [(3, 8, 4), (4, 1, 1), (2, 16, 6)])
def test_greedy_eagle3_is_lossless(plain: LLM, tiny_model_dir: Path, tiny_head: Path,
                                   shape: tuple[int, int, int]) -> None:
    depth, nodes, topk = shape
    config = eagle3(tiny_head, depth, nodes if nodes > 1 else 0, eagle_topk=topk)
    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=config)
    assert spec.engine.runner.executor.feature_layers == (0, 1, 1)
    for seed in range(3):
        prompts = random_prompts(seed, 4)
        assert token_ids(spec.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    metrics = spec.get_metrics()
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] >= metrics["num_drafts"]
    assert_all_blocks_free(spec)
    _check_drafter_empty(spec)


def test_eagle3_with_chunked_prefill_and_preemption(plain: LLM, tiny_model_dir: Path, tiny_head: Path) -> None:
    prompts = random_prompts(100, 6)
    expected = token_ids(plain.generate(prompts, greedy()))
    spec = LLM(str(tiny_model_dir), max_model_len=128, max_num_batched_tokens=24,
               kv_cache_memory=9 * block_bytes(plain), speculative_config=eagle3(tiny_head))
    assert step_mixed(spec.engine, prompts, greedy()) == expected
    metrics = spec.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["num_drafts"] > 0
    assert_all_blocks_free(spec)
    _check_drafter_empty(spec)


@needs_the_loop
def test_eagle3_on_the_cpp_layer_loop_is_lossless(d32_dir: Path, d32_head: Path) -> None:
    plain32 = LLM(str(d32_dir), max_model_len=128, speculative_config=None)
    spec = LLM(str(d32_dir), max_model_len=128, max_num_batched_tokens=24, kv_cache_memory=9 * block_bytes(plain32),
               speculative_config=eagle3(d32_head, 4, 10, eagle_topk=3))
    assert isinstance(spec.engine.runner.executor, CppLayerLoop) and spec.engine.runner.executor.layers is not None
    assert spec.engine.model.attention_backend.name == "cpp"
    prompts = random_prompts(7, 5)
    assert step_mixed(spec.engine, prompts, greedy()) == token_ids(plain32.generate(prompts, greedy()))
    metrics = spec.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["num_drafts"] > 0
    assert_all_blocks_free(spec)
    _check_drafter_empty(spec)


def test_eagle3_with_adaptive_speculation_and_prefix_caching(plain: LLM, tiny_model_dir: Path,
                                                            tiny_head: Path) -> None:
    """The policy cuts EAGLE-3 trees by their chances; a prefix cache hit leaves positions
    without features (the head's context starts after them) and output is still plain's."""
    spec = LLM(str(tiny_model_dir), max_model_len=256, enable_prefix_caching=True,
               speculative_config=eagle3(tiny_head, 4, 12, adaptive=True))
    prompts = [p * 3 for p in random_prompts(3, 3)]  # long enough to fill whole cached blocks
    for _ in range(2):  # the second pass hits the prefix cache
        assert token_ids(spec.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    assert spec.get_metrics()["prefix_cache_hits"] > 0
    assert_all_blocks_free(spec)
    _check_drafter_empty(spec)


# ---- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("config, needle", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, "'eagle3' needs 'model'"),
    ({"method": "eagle3", "model": "x", "eagle_topk": 0, "num_tree_nodes": 8}, "eagle_topk must be an integer"),
    ({"method": "eagle3", "model": "x", "eagle_topk": 3}, "eagle_topk 3 needs num_tree_nodes > 0"),
    ({"method": "eagle3", "model": "x", "num_tree_nodes": 8, "tree_choices": [[0]]}, "tree_choices applies"),
    ({"method": "ngram", "eagle_topk": 2}, "eagle_topk applies to methods 'eagle3' and 'hybrid' only"),
])
def test_bad_eagle3_configs_are_refused_by_name(tiny_model_dir: Path, config: dict[str, object],
                                                needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        LLM(str(tiny_model_dir), speculative_config=config)


def test_a_missing_head_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no EAGLE-3 head at"):
        LLM(str(tiny_model_dir), speculative_config=eagle3(tmp_path / "nothing"))


def test_a_head_for_another_target_is_refused(tiny_model_dir: Path, d32_head: Path) -> None:
    with pytest.raises(ValueError, match="aux_hidden_state_layer_ids|target_hidden_size"):
        LLM(str(tiny_model_dir), speculative_config=eagle3(d32_head))


# ---- accepted drafts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A target whose final norm is zero: every logit is 0, so greedy decoding emits token 0
    forever, and a head drafting token 0 is always right."""
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path_factory.mktemp("zero-target"))
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("draft_vocab, topk, nodes", [(1, 1, 0), (2, 2, 8)])
def test_accepted_drafts_keep_the_head_in_step(zero_target: Path, tmp_path: Path, draft_vocab: int, topk: int,
                                               nodes: int) -> None:
    """Drafts the target accepts (their rows' features go to the head, a tree's accepted
    path moves in the KV cache) keep every later step drafting: a head drafting token 0
    alone (draft vocabulary [0]) is right at every depth, one drafting tokens 0 and 1 is
    right along one path of its tree."""
    head = make_eagle3_head(tmp_path, zero_target, draft_vocab_size=draft_vocab)
    depth, max_tokens = 4, 41
    plain_zero = LLM(str(zero_target), max_model_len=128, speculative_config=None)
    spec = LLM(str(zero_target), max_model_len=128,
               speculative_config=eagle3(head, depth, nodes, **({"eagle_topk": topk} if nodes else {})))
    prompts = random_prompts(21, 3)
    expected = token_ids(plain_zero.generate(prompts, greedy(max_tokens)))
    assert all(set(tokens) == {0} for tokens in expected)
    assert token_ids(spec.generate(prompts, greedy(max_tokens))) == expected
    metrics = spec.get_metrics()
    if draft_vocab == 1:  # every draft accepted: each verify step commits depth + 1 tokens
        assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"] == depth * metrics["num_drafts"]
        assert metrics["num_drafts"] == len(prompts) * (max_tokens - 1) // (depth + 1)
    else:
        assert metrics["num_accepted_tokens"] >= metrics["num_drafts"] > 0
    assert_all_blocks_free(spec)
    _check_drafter_empty(spec)


def test_seeded_sampling_with_eagle3_trees_is_plain_sampling(plain: LLM, tiny_model_dir: Path,
                                                             tiny_head: Path) -> None:
    """Temperature 1, seeded: draws are keyed by position and the trees' guesses are
    verified one-hot, so speculation commits exactly plain sampling's tokens."""
    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=eagle3(tiny_head, 3, 8))
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=seed) for seed in range(4)]
    prompts = random_prompts(30, 4)
    assert token_ids(spec.generate(prompts, params)) == token_ids(plain.generate(prompts, params))
    assert spec.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(spec)


@pytest.mark.parametrize("adaptive", [False, True])
def test_hybrid_with_an_eagle3_head_is_lossless(plain: LLM, tiny_model_dir: Path, tiny_head: Path,
                                                adaptive: bool) -> None:
    """The hybrid drafter takes an EAGLE-3 head as its costlier option beside suffix drafts."""
    from specdec.drafters.hybrid import HybridDrafter

    spec = LLM(str(tiny_model_dir), max_model_len=256, speculative_config={
        "method": "hybrid", "model": str(tiny_head), "num_speculative_tokens": 6, "num_tree_nodes": 12,
        "adaptive": adaptive})
    drafter = spec.engine.drafter
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.heads, Eagle3Drafter)
    assert spec.engine.runner.executor.feature_layers == (0, 1, 1) and not drafter.reads_hidden
    prompts = random_prompts(50, 4)
    assert token_ids(spec.generate(prompts, greedy())) == token_ids(plain.generate(prompts, greedy()))
    if not adaptive:  # the fixed policy takes every option offered: the head drafted
        assert drafter.heads_seconds.w > 0
    assert drafter.heads.contexts == {} and drafter.heads.block_manager.num_free_blocks == \
        drafter.heads.block_manager.num_blocks
    assert_all_blocks_free(spec)


# ---- on a GPU ------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_graphs_capture_features_and_eagle3_stays_lossless(tiny_model_dir: Path, tiny_head: Path) -> None:
    """A replayed graph writes the features into its static buffer, the same as the eager
    forward of the step; EAGLE-3 over CUDA graphs gives eager plain decoding's tokens."""
    from specdec.cuda_graphs import CudaGraphs
    from specdec.kernels import attention_triton
    from tests.engine.test_cuda import cuda_llm

    if type(attention_triton._paged_attention_kernel).__name__ == "InterpretedFunction":
        pytest.skip("Triton runs interpreted in this session; on a GPU run TRITON_INTERPRET=0 pytest -m cuda")
    cuda = torch.device("cuda")
    graphed = cuda_llm(tiny_model_dir, speculative_config=eagle3(tiny_head))
    executor = graphed.engine.runner.executor
    assert isinstance(executor, CudaGraphs) and executor.features is not None
    assert executor.eager.feature_layers == executor.feature_layers == (0, 1, 1)
    kv = graphed.engine.runner.kv_cache.layers
    with torch.inference_mode():
        executor.run(_prefill([5, 9, 11, 3]), kv, cuda)
        step = StepInputs([7], [4], [4], [1], [5], [[0]], [1], None, [0])  # a decode step: a graph shape
        replayed, eager = executor.run(step, kv, cuda), executor.eager.run(step, kv, cuda)
    assert replayed.features is not None and eager.features is not None and replayed.features.shape == (1, 192)
    torch.testing.assert_close(replayed.features, eager.features)
    prompts = random_prompts(5, 3)
    plain_cuda = cuda_llm(tiny_model_dir, enforce_eager=True, speculative_config=None)
    expected = token_ids(plain_cuda.generate(prompts, greedy(12)))
    assert token_ids(graphed.generate(prompts, greedy(12))) == expected
    assert graphed.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(graphed)
    _check_drafter_empty(graphed)


def test_the_eagle3_hybrid_config_names_the_shipped_head() -> None:
    from specdec.config import DEFAULT_HEADS, EAGLE3_HEADS, default_speculative_config, eagle3_hybrid_config
    from specdec.drafters.eagle3 import SHIPPED, is_eagle3_dir
    from specdec.model_registry import DEFAULT_MODEL

    config = eagle3_hybrid_config()
    assert (config.method, config.model, config.adaptive) == ("hybrid", EAGLE3_HEADS, True)
    default = default_speculative_config(DEFAULT_MODEL, torch.device("cpu"))
    assert default is not None and default.model == DEFAULT_HEADS  # not the default
    assert not is_eagle3_dir(DEFAULT_HEADS)  # recurrent heads: the hybrid builds those
    if (SHIPPED / EAGLE3_HEADS).is_dir():
        assert is_eagle3_dir(EAGLE3_HEADS)
