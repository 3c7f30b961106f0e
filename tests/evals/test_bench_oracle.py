"""bench_oracle on the tiny checkpoint: the oracle's guesses are the plain continuation, so
every one is accepted and the outputs equal plain decoding's."""
from __future__ import annotations

from pathlib import Path

from specdec.drafters.base import DraftRequest
from specdec.evals import bench_oracle
from specdec.sampling_params import SamplingParams


def _request(token_ids: list[int], num_draft_tokens: int = 8, max_depth: int = 8) -> DraftRequest:
    return DraftRequest("r", token_ids, num_draft_tokens, max_depth, SamplingParams(temperature=0.0))


def test_oracle_drafts_the_expected_tokens_within_the_limits() -> None:
    oracle = bench_oracle.OracleDrafter()
    oracle.expected, oracle.depth = [5, 6, 7, 8, 9, 10], 3
    assert oracle.propose([_request([5, 6])])[0].token_ids == [6, 7, 8, 9]
    assert oracle.propose([_request([5, 6], max_depth=2)])[0].token_ids == [6, 7, 8]
    assert oracle.propose([_request([5, 6, 7, 8, 9])])[0].token_ids == [9, 10]  # the end of what it knows
    assert oracle.num_misses == 0
    assert oracle.propose([_request([5, 7])])[0].token_ids == [7]  # off the expected tokens: no guess
    assert oracle.num_misses == 1


def test_every_oracle_guess_is_accepted_and_outputs_equal_plain(tiny_model_dir: Path) -> None:
    llm, oracle = bench_oracle.build_llm(str(tiny_model_dir), 4, 512)
    before = llm.get_metrics()
    row = bench_oracle.measure(llm, oracle, ["Tell me a story.", "Shorter."], [1, 4], 12)
    after = llm.get_metrics()
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    assert drafted > 0 and after["num_accepted_tokens"] - before["num_accepted_tokens"] == drafted
    assert row["differ"] == 0 and oracle.num_misses == 0
    assert row["turns"] == 2 and set(row["oracle"]) == {1, 4}
    assert 0 < row["prefill"] and 0 < row["plain"]


def test_main_reports_every_depth(tiny_model_dir: Path) -> None:
    summaries = bench_oracle.main(["--model", str(tiny_model_dir), "--categories", "qa", "--num-prompts", "1",
                                   "--max-tokens", "6", "--depths", "1,3", "--max-model-len", "512"])
    assert [s["category"] for s in summaries] == ["qa", "all"]
    assert set(summaries[-1]["speedup"]) == {1, 3} and summaries[-1]["differ"] == 0
