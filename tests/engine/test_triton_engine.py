"""The whole engine on the triton attention backend, run on CPU tensors by Triton's
interpreter: greedy outputs equal the torch backend's, plain and speculative (n-gram,
draft-model tree, Medusa tree), batched, with every KV block freed. Then the CUDA graph executor
(specdec/cuda_graphs.py) with its graphs replayed eagerly: every step padded to its graph
shape and read from the static buffers gives the same outputs, so what a graph replays on
a GPU is the right computation.

The interpreter is slow: tiny checkpoints, three prompts, a few tokens each.
"""
import os

# Must precede any import of triton (see tests/kernels/test_attention_triton.py).
os.environ.setdefault("TRITON_INTERPRET", "1")  # an explicit 0 (`-m cuda` on a GPU) stands

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specdec import cuda_graphs  # noqa: E402
from specdec.cuda_graphs import CapturedStep, CudaGraphs  # noqa: E402
from specdec.kernels.linear import Fp32Linear  # noqa: E402
from specdec.llm import LLM  # noqa: E402
from tests.helpers import NGRAM, assert_all_blocks_free, greedy, random_prompts, token_ids  # noqa: E402

MAX_TOKENS = 6
MEDUSA_TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]


def spec_config(method: str, draft_dir: Path, medusa_dir: Path) -> dict[str, Any] | None:
    return {
        "plain": None,
        "ngram": NGRAM,
        "draft_model_tree": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3,
                             "num_tree_nodes": 6},
        "medusa_tree": {"method": "medusa", "model": str(medusa_dir), "num_speculative_tokens": 3,
                        "num_tree_nodes": 6, "tree_choices": MEDUSA_TREE},
    }[method]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, 3)


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Plain greedy decoding on the torch backend: what every run below must produce."""
    llm = LLM(str(tiny_model_dir), max_model_len=128, attention_backend="torch")
    return token_ids(llm.generate(prompts, greedy(MAX_TOKENS)))


def make_llm(method: str, model_dir: Path, draft_dir: Path, medusa_dir: Path) -> LLM:
    return LLM(str(model_dir), max_model_len=128, attention_backend="triton",
               speculative_config=spec_config(method, draft_dir, medusa_dir))


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model_tree", "medusa_tree"])
def test_triton_engine_equals_torch(method: str, tiny_model_dir: Path, tiny_draft_dir: Path, tiny_medusa_dir: Path,
                                    prompts: list[list[int]], expected: list[list[int]]) -> None:
    llm = make_llm(method, tiny_model_dir, tiny_draft_dir, tiny_medusa_dir)
    assert llm.engine.model.attention_backend.name == "triton"
    assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS))) == expected
    if method != "plain":
        assert llm.get_metrics()["num_drafts"] > 0
    assert_all_blocks_free(llm)


class ReplayedEagerly:
    """A CUDA graph's CPU stand-in: replaying runs the captured forward again, into the
    buffer the capture returned."""

    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self.forward = forward
        self.output = forward()
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.forward())


def capture_eagerly(forward: Callable[[], torch.Tensor], pool: object, device: torch.device) -> CapturedStep:
    graph = ReplayedEagerly(forward)
    return CapturedStep(graph, graph.output)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["ngram", "medusa_tree"])
def test_graph_runner_replays_padded_steps(method: str, tiny_model_dir: Path, tiny_draft_dir: Path,
                                           tiny_medusa_dir: Path, prompts: list[list[int]],
                                           expected: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaGraphs with each graph replaced by an eager rerun of its forward over the
    static buffers: the buffers, the padding and the gathering of the rows are the ones a
    GPU replays."""
    monkeypatch.setattr(cuda_graphs, "capture_graph", capture_eagerly)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    llm = LLM(str(tiny_model_dir), max_model_len=128, max_num_seqs=4, attention_backend="triton",
              speculative_config=spec_config(method, tiny_draft_dir, tiny_medusa_dir))
    engine = llm.engine
    runner = engine.runner
    graphs = CudaGraphs(runner.executor, engine.config, runner.kv_cache, engine.device, engine.max_model_len)
    runner.executor = graphs
    assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS))) == expected
    replayed = {shape for shape, step in graphs.captured.items() if step.graph.replays}  # type: ignore[attr-defined]
    # Verify steps ran padded: queries to the lookahead, 3 requests to the 4-request shape.
    assert any(s.query_len > 1 and s.masked == (method == "medusa_tree") for s in replayed)
    assert any(s.batch_size == 4 for s in replayed)
    captured = dict(graphs.captured)
    graphs.use_linear_backend(Fp32Linear())  # a repack captures every shape again, on the new packings
    assert all(graphs.captured[shape] is not step for shape, step in captured.items())
    assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS))) == expected
    assert_all_blocks_free(llm)
