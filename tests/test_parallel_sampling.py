"""n > 1: a parent request fans out into seeded children whose outputs merge back."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.parallel_sampling import ParentRequest
from specdec.sampling_params import SamplingParams


def _output(request_id: str, text: str, finished: bool, error: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, text, [ord(c) for c in text], "length" if finished else None)
    return RequestOutput(request_id, "p", [1, 2], [completion], finished, error=error)


def test_children_have_their_own_ids_and_seeds() -> None:
    parent = ParentRequest("r", SamplingParams(n=3, seed=7, temperature=1.0))
    assert parent.child_ids == ["r-0", "r-1", "r-2"]
    assert [(c.index, c.params.n, c.params.seed) for c in parent.children] == [(0, 1, 7), (1, 1, 8), (2, 1, 9)]
    unseeded = ParentRequest("u", SamplingParams(n=2))
    assert [c.params.seed for c in unseeded.children] == [None, None]
    single = SamplingParams(seed=1)
    only = ParentRequest("s", single)
    assert only.child_ids == ["s"] and only.children[0].params is single


def test_merge_indexes_completions_and_fills_the_missing() -> None:
    parent = ParentRequest("r", SamplingParams(n=3, logprobs=1))
    parent.update(_output("r-2", "cc", finished=True))
    parent.update(_output("r-0", "a", finished=False))
    merged = parent.merged()
    assert merged.request_id == "r" and not merged.finished and not parent.finished
    assert [(c.index, c.text) for c in merged.outputs] == [(0, "a"), (1, ""), (2, "cc")]
    assert merged.outputs[1].logprobs == []  # nothing yet, but logprobs were asked for
    parent.update(_output("r-0", "aa", finished=True))
    parent.update(_output("r-1", "b", finished=True, error="boom"))
    merged = parent.merged()
    assert merged.finished and parent.finished and merged.error == "boom"
    assert [c.text for c in merged.outputs] == ["aa", "b", "cc"]


class _RefusingEngine:
    """Refuses the second request it is given."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, use_speculation: bool = True,
                    grammar: Any = None) -> None:
        if len(self.added) == 1:
            raise ValueError("refused")
        self.added.append(request_id)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_refused_child_aborts_the_added_ones() -> None:
    engine = _RefusingEngine()
    with pytest.raises(ValueError, match="refused"):
        ParentRequest("r", SamplingParams(n=3)).add_to(engine, "hi")
    assert engine.added == engine.aborted == ["r-0"]


def test_llm_n3_is_three_seeded_requests(tiny_model_dir: Path) -> None:
    from specdec.llm import LLM

    llm = LLM(str(tiny_model_dir), max_model_len=64, kv_cache_memory=1 << 20)
    params = dict(temperature=2.0, max_tokens=8, ignore_eos=True)
    [merged] = llm.generate("The quick brown fox", SamplingParams(n=3, seed=5, **params))  # type: ignore[arg-type]
    assert merged.finished and [c.index for c in merged.outputs] == [0, 1, 2]
    alone = llm.generate(["The quick brown fox"] * 3,
                         [SamplingParams(seed=5 + i, **params) for i in range(3)])  # type: ignore[arg-type]
    assert [c.token_ids for c in merged.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in merged.outputs}) > 1  # distinct seeds, distinct samples
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
