"""The distillation prompt set: disjoint from the evaluation prompts, and grown only by
appending, so earlier splits and cached shards stay valid."""
from __future__ import annotations

import json
from pathlib import Path

from specdec.drafters import distill_data as dd

EVAL_PROMPTS = Path(__file__).parents[2] / "evals" / "prompts"


def _writing() -> set[str]:
    pool = dd.prompt_pools()["writing"]
    prompts = {t.format(x=x) for t in pool["templates"] for x in pool["topics"]}
    return prompts | {t.format(role=r, audience=a) for t in pool["role_plays"] for r, a in pool["roles"]}


def test_no_distillation_prompt_is_an_evaluation_prompt() -> None:
    turns = {turn for path in EVAL_PROMPTS.glob("*.jsonl")
             for line in path.read_text().splitlines() if line.strip()
             for turn in json.loads(line).get("turns", [])}
    assert turns and not set(dd.build_prompts()) & turns


def test_writing_then_open_chat_prompts_come_after_the_earlier_sets() -> None:
    prompts, writing, open_chat = dd.build_prompts(), _writing(), set(dd._open_chat_prompts())
    assert len(prompts) == 697 + len(writing) + len(open_chat) == 1085
    assert set(prompts[697 : 697 + len(writing)]) == writing and set(prompts[697 + len(writing) :]) == open_chat
    split = dd.split_prompts(633, 64)
    assert not (set(split["heldout"]) | set(split["train"])) & (writing | open_chat)
    assert dd.split_prompts(753, 64)["train"][:633] == split["train"]
    assert dd.split_prompts(1021, 64)["train"][:753] == dd.split_prompts(753, 64)["train"]


def test_self_instruct_prompts_extend_both_splits_and_the_tag(tmp_path: Path) -> None:
    cfg = dd.DistillConfig(num_train=100, num_heldout=4, num_self_instruct=6)
    path = tmp_path / "self_instruct.json"
    drawn = [f"user message {i}" for i in range(10)]
    path.write_text(json.dumps(drawn))
    splits = dd.split_prompts(cfg.num_train, cfg.num_heldout)
    dd.add_self_instruct(splits, cfg, path)
    assert splits["heldout"][4:] == drawn[:4] and splits["train"][100:] == drawn[4:]
    assert splits["train"][:100] == dd.split_prompts(100, 4)["train"]
    assert cfg.tag().endswith("-s6") and not dd.DistillConfig(num_train=100, num_heldout=4).tag().endswith("-s6")
