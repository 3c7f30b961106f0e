"""A seeded request's output does not depend on speculation: n-gram chains, suffix trees
and plain decoding give the same tokens (the verifier's draws are keyed by position)."""
from __future__ import annotations

from pathlib import Path

from specdec import SamplingParams
from specdec.llm import LLM
from tests.helpers import assert_all_blocks_free, random_prompts, token_ids

CONFIGS: dict[str, dict | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6, "num_tree_nodes": 8},
}


def test_seeded_output_is_the_same_with_and_without_speculation(tiny_model_dir: Path) -> None:
    """The tiny model's sampled text is noise, so drafts come from repeats: the second pass
    of each engine meets the first pass's outputs (suffix decoding's cross-request cache
    drafts them whole). With the same seeds those drafts are the target's own picks and are
    accepted; the last request has another seed, and so another text."""
    prompts = random_prompts(7, 4)
    seeds = [0, 1, 2, 2**40]
    first = [SamplingParams(temperature=0.8, seed=s, max_tokens=32, ignore_eos=True) for s in seeds]
    second = first[:3] + [SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)]
    second_prompts = prompts[:3] + [prompts[0]]
    outputs = {}
    for name, config in CONFIGS.items():
        llm = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=config)
        outputs[name] = token_ids(llm.generate(prompts, first)) + token_ids(llm.generate(second_prompts, second))
        assert_all_blocks_free(llm)
        if name == "suffix":
            metrics = llm.get_metrics()
            assert metrics["num_accepted_tokens"] > 32, (name, metrics)
    assert outputs["ngram"] == outputs["plain"]
    assert outputs["suffix"] == outputs["plain"]
    assert len({tuple(t) for t in outputs["plain"][:4]}) == len(prompts)  # the requests differ
    assert outputs["plain"][7] != outputs["plain"][0]  # another seed, another text


def test_seeded_output_is_reproducible_run_to_run(tiny_model_dir: Path) -> None:
    """Same seed, same text, whether the request runs alone or with others; another seed differs."""
    llm = LLM(str(tiny_model_dir), max_model_len=256, speculative_config=CONFIGS["ngram"])
    prompt = random_prompts(8, 1)[0]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    alone = token_ids(llm.generate([prompt], params))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3
    assert token_ids(llm.generate([prompt] + random_prompts(9, 3), [params] + others))[0] == alone
    assert token_ids(llm.generate([prompt], SamplingParams(temperature=0.8, seed=6, max_tokens=24,
                                                           ignore_eos=True)))[0] != alone
