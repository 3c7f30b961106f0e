"""bench_llamacpp's bookkeeping: which round a prompt keeps, decode rates, groups and
ratios to llama.cpp, the concurrent workload; and the engine-stepping timer on the tiny
checkpoint. Nothing here installs or runs llama.cpp."""
from __future__ import annotations

from pathlib import Path

import pytest

from specdec.evals import bench_llamacpp as bench
from specdec.evals import llamacpp_concurrency as concurrency
from specdec.evals import llamacpp_methods as methods
from specdec.llm import LLM


def run(first_s: float, last_s: float, tokens: list[int], **counts: int) -> dict[str, object]:
    return {"first_s": first_s, "last_s": last_s, "tokens": tokens, **counts}


def test_keep_per_prompt_takes_the_fastest_or_the_median_round() -> None:
    rounds = [[run(0, 3, [1]), run(0, 1, [2])], [run(0, 1, [3]), run(0, 5, [4])], [run(0, 2, [5]), run(0, 3, [6])]]
    assert [r["tokens"] for r in bench.keep_per_prompt(rounds, "best")] == [[3], [2]]
    assert [r["tokens"] for r in bench.keep_per_prompt(rounds, "median")] == [[5], [6]]
    two = rounds[:2]  # an even count keeps the lower middle: a real run, not an average
    assert [r["tokens"] for r in bench.keep_per_prompt(two, "median")] == [[3], [2]]


def test_decode_rate_counts_tokens_after_the_first() -> None:
    runs = [run(1.0, 2.0, [0] * 11), run(0.5, 4.5, [0] * 21)]
    assert bench.decode_rate(runs) == pytest.approx(30 / 5)


def test_leading_agreement() -> None:
    assert bench.leading_agreement([1, 2, 3], [1, 2, 4]) == 2
    assert bench.leading_agreement([1, 2], [1, 2, 3]) == 2
    assert bench.leading_agreement([5], [1]) == 0


def test_rotated_starts_each_round_elsewhere() -> None:
    assert bench.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bench.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert bench.rotated([], 3) == []


def test_parse_method() -> None:
    assert methods.parse_method("plain") == ("specdec plain", None, ("gguf", "float32"))
    assert methods.parse_method("plain@none") == ("specdec plain (dequantized)", None, ("none", "float32"))
    assert methods.parse_method("ngram@int8")[2] == ("gguf", "int8")
    assert methods.parse_method("default")[1] == "auto"
    assert methods.parse_method("suffix")[1] == {"method": "suffix", "num_speculative_tokens": 8,
                                               "num_tree_nodes": 12, "adaptive": True}
    assert methods.parse_method("medusa-rec-tree6")[1]["num_tree_nodes"] == 6  # type: ignore[index]
    for bad in ("nope", "plain@q8", "ngram@"):
        with pytest.raises(SystemExit):
            methods.parse_method(bad)


def test_groups_split_the_categories() -> None:
    grounded, other = methods.GROUPS["input-grounded"], methods.GROUPS["other"]
    assert set(grounded) == {"summarization", "rag", "code:rewrite"}
    assert not set(grounded) & set(other) and "code:complete" in other


def test_batch1_rows_group_rates_and_ratios() -> None:
    prompts = [methods.Prompt("rag", "input-grounded", [1]), methods.Prompt("qa", "other", [2])]
    kept = {
        methods.LLAMACPP: [run(0, 1, [1, 2, 3]), run(0, 1, [4, 5, 6])],
        "specdec plain": [run(0, 0.5, [1, 2, 3]), run(0, 2, [4, 5, 7])],
        "specdec ngram": [run(0, 0.25, [1, 2, 3], drafts=2, drafted=8, accepted=4),
                          run(0, 1, [4, 5, 7], drafts=2, drafted=8, accepted=0)],
    }
    rows = {r["engine"]: r for r in bench.batch1_rows(kept, prompts)}
    plain, ngram = rows["specdec plain"], rows["specdec ngram"]
    assert plain["input-grounded tok/s"] == pytest.approx(4)
    assert plain["input-grounded vs llama.cpp"] == pytest.approx(2)
    assert plain["other vs llama.cpp"] == pytest.approx(0.5)
    assert plain["overall tok/s"] == pytest.approx(4 / 2.5) and rows[methods.LLAMACPP]["overall vs llama.cpp"] == 1
    assert plain["agree llama.cpp"] == pytest.approx(2.5) and plain["same as plain"] == 2
    assert ngram["tau"] == pytest.approx(2) and ngram["acceptance"] == pytest.approx(0.25)
    assert rows[methods.LLAMACPP]["tau"] is None and rows[methods.LLAMACPP]["same as plain"] == 1


def test_workload_mixes_categories_round_robin() -> None:
    prompts = [methods.Prompt("a", "g", [1]), methods.Prompt("a", "g", [2]), methods.Prompt("b", "g", [3])]
    assert concurrency.make_workload(prompts, 5) == [[1], [3], [2], [1], [3]]


def test_concurrency_rows_keep_the_best_round() -> None:
    rounds = {"llama-server": [{"tokens": 100, "seconds": 2.0, "peak_rss": 2**20},
                               {"tokens": 100, "seconds": 1.0, "peak_rss": 3 * 2**20}],
              "specdec LLM.generate plain": [{"tokens": 100, "seconds": 0.5}]}
    rows = {r["engine"]: r for r in concurrency.concurrency_rows(rounds, {"llama-server": 2**21})}
    assert rows["llama-server"]["tok/s"] == 100 and rows["llama-server"]["peak RSS MB"] == 3
    assert rows["llama-server"]["idle RSS MB"] == 2
    assert rows["specdec LLM.generate plain"]["vs llama-server"] == 2
    assert rows["specdec LLM.generate plain"]["peak RSS MB"] is None


def test_run_specdec_stamps_the_first_token(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              max_model_len=256)
    out = bench.run_specdec(llm, [1, 2, 3, 1, 2, 3, 1, 2], 12)
    assert len(out["tokens"]) == 12 and 0 < out["first_s"] <= out["last_s"]
    assert out["drafted"] >= out["accepted"] >= 0


def test_a_round_does_not_draft_from_its_prompts_earlier_runs(tiny_model_dir: Path) -> None:
    """Suffix decoding caches every answer: without emptying that cache, a second round
    would draft each prompt's whole answer from its first run."""
    llm = LLM(str(tiny_model_dir), speculative_config={"method": "suffix", "num_speculative_tokens": 8},
              max_model_len=256)
    prompt = [5, 9, 17, 33, 65, 129]
    first = bench.run_specdec(llm, prompt, 24)
    repeat = bench.run_specdec(llm, prompt, 24)
    assert repeat["accepted"] > first["accepted"]  # the cached answer was drafted
    bench.forget_earlier_rounds(llm)
    assert bench.run_specdec(llm, prompt, 24)["accepted"] == first["accepted"]
    bench.forget_earlier_rounds(LLM(str(tiny_model_dir), max_model_len=64, speculative_config=None))  # no drafter
