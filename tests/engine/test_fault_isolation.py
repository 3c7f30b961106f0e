"""One request's fault never harms another: a grammar that fails mid-generation (the
recursive schema that makes llguidance give up, or any exception while a request is
drafted, masked or committed) ends that request with its own error, and the requests
beside it finish exactly as they would have without it. The error tells its client only
what is its own; the log has the rest."""
from __future__ import annotations

from typing import Any

import pytest

from specdec import SamplingParams
from specdec.llm import LLM
from specdec.sampling_params import StructuredOutputsParams
from specdec.structured_output import Grammar, GrammarError
from tests.helpers import NGRAM, assert_all_blocks_free, greedy, random_prompts

# Every object must hold another: no finite JSON matches, and llguidance stops on its item limit.
RECURSIVE = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {
    "SECRET_TENANT_A_FIELD": {"$ref": "#/$defs/n"}}, "required": ["SECRET_TENANT_A_FIELD"]}}}
HEALTHY = random_prompts(seed=41, count=4)


@pytest.fixture(scope="module", params=["plain", "ngram", "overlap"])
def llm(request: pytest.FixtureRequest, tiny_model_dir: Any) -> LLM:
    """overlap: plain decoding with overlap scheduling, each step committed one step late."""
    spec = NGRAM if request.param == "ngram" else None
    return LLM(str(tiny_model_dir), max_model_len=256, speculative_config=spec,
               async_scheduling=request.param == "overlap")


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
        patch: dict[int, Any] | None = None) -> dict[str, Any]:
    """Step the requests together; `patch` replaces a method of request i's grammar."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        request = engine.add_request(f"q{i}", prompt, p)
        for name, method in (patch or {}).get(i, {}).items():
            setattr(request.grammar, name, method.__get__(request.grammar))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def healthy_alone(llm: LLM) -> list[list[int]]:
    finals = run(llm, HEALTHY, [greedy(24)] * len(HEALTHY))
    return [list(finals[f"q{i}"].outputs[0].token_ids) for i in range(len(HEALTHY))]


def test_a_recursive_schema_fails_alone(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    expected = healthy_alone(llm)
    bad = SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(json=RECURSIVE))
    finals = run(llm, [*HEALTHY, [5, 6, 7]], [greedy(24)] * len(HEALTHY) + [bad])
    assert [list(finals[f"q{i}"].outputs[0].token_ids) for i in range(len(HEALTHY))] == expected
    assert all(finals[f"q{i}"].outputs[0].finish_reason == "length" for i in range(len(HEALTHY)))
    failed = finals[f"q{len(HEALTHY)}"]
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error is not None and failed.error.startswith("structured outputs: the grammar failed")
    assert "SECRET" not in failed.error and "<grammar>" not in failed.error and "Traceback" not in failed.error
    assert_all_blocks_free(llm)


def failing_after(count: int, error: Exception) -> Any:
    """A Grammar.advance that fails once `count` output tokens are committed."""
    def advance(self: Grammar, output_token_ids: Any) -> None:
        if len(output_token_ids) >= count:
            raise error
        Grammar.advance(self, output_token_ids)
    return advance


@pytest.mark.parametrize(("method", "error", "told"), [
    ("advance", GrammarError("structured outputs: the grammar failed at output token 3: x"), "output token 3"),
    ("advance", RuntimeError("SECRET internals of another tenant"), "internal error while committing"),
    ("masks", RuntimeError("SECRET mask"), "internal error while masking"),
    ("forced_tokens", RuntimeError("SECRET force"), None),
])
def test_any_fault_of_one_request_ends_it_alone(llm: LLM, method: str, error: Exception, told: str | None) -> None:
    expected = healthy_alone(llm)
    regex = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    if method == "advance":
        broken = failing_after(3, error)
    else:
        def broken(self: Grammar, *args: Any) -> Any:
            raise error
    finals = run(llm, [*HEALTHY, [5, 6, 7]], [greedy(24)] * len(HEALTHY) + [regex],
                 patch={len(HEALTHY): {method: broken}})
    assert [list(finals[f"q{i}"].outputs[0].token_ids) for i in range(len(HEALTHY))] == expected
    failed = finals[f"q{len(HEALTHY)}"]
    if told is None:  # forced tokens are drafted only when speculating
        told = "internal error while drafting" if llm.engine.drafter is not None else None
    if told is None:
        assert failed.outputs[0].finish_reason == "length"
    else:
        assert failed.outputs[0].finish_reason == "error" and told in (failed.error or "")
        assert "SECRET" not in (failed.error or "")
    assert_all_blocks_free(llm)


def test_a_failing_drafter_fails_only_the_request_it_fails_on(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=NGRAM)
    expected = healthy_alone(llm)
    drafter = llm.engine.drafter
    assert drafter is not None
    propose = drafter.propose

    def fail_on_poison(requests: Any) -> Any:
        if any(r.token_ids[:3] == [9, 9, 9] for r in requests):
            raise RuntimeError("SECRET drafter state")
        return propose(requests)

    drafter.propose = fail_on_poison  # type: ignore[method-assign]
    finals = run(llm, [*HEALTHY, [9, 9, 9, 9, 9, 9]], [greedy(24)] * (len(HEALTHY) + 1))
    assert [list(finals[f"q{i}"].outputs[0].token_ids) for i in range(len(HEALTHY))] == expected
    failed = finals[f"q{len(HEALTHY)}"]
    assert failed.outputs[0].finish_reason == "error"
    assert "internal error while drafting" in (failed.error or "") and "SECRET" not in (failed.error or "")
    assert_all_blocks_free(llm)
