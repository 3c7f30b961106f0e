"""LLM's vLLM-shaped API on the tiny checkpoint: prompt dicts, Logprob objects and
cumulative_logprob, chat's keyword arguments, and the chat_template engine option."""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specdec.chat_utils import load_chat_template, render_chat
from specdec.llm import LLM
from specdec.outputs import Logprob
from tests.fixtures import CHATML
from tests.helpers import assert_all_blocks_free, greedy, token_ids

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "hi"}]
# A template of our own: every message as "role: content", then "assistant:" when asked.
PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    yield LLM(str(tiny_model_dir), max_model_len=64, kv_cache_memory=1 << 20)


def test_the_package_exports_llm_and_async_llm() -> None:
    """`from specdec import LLM` (the README's import) is the class the tests import from
    specdec.llm: the package loads it only when asked."""
    import specdec
    from specdec.async_llm import AsyncLLM

    assert specdec.LLM is LLM and specdec.AsyncLLM is AsyncLLM


# ---- prompt forms ------------------------------------------------------------------------


def test_prompt_dicts_match_plain_prompts(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    plain = token_ids(llm.generate([PROMPT, ids], greedy(8)))
    assert token_ids(llm.generate({"prompt": PROMPT}, greedy(8))) == plain[:1]
    assert token_ids(llm.generate({"prompt_token_ids": ids}, greedy(8))) == plain[1:]
    mixed = llm.generate([{"prompt": PROMPT}, PROMPT, {"prompt_token_ids": ids}, ids], greedy(8))
    assert token_ids(mixed) == plain[:1] * 2 + plain[1:] * 2
    assert mixed[0].prompt == PROMPT and mixed[2].prompt_token_ids == ids


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": PROMPT, "cache_salt": "x"}, r"unknown prompt dict keys \['cache_salt'\]"),
    ({}, "exactly one of .*got neither"),
    ({"prompt": PROMPT, "prompt_token_ids": [1, 2]}, r"exactly one of .*\['prompt', 'prompt_token_ids'\]"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": None}}, "multi_modal_data is not supported"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt_token_ids": "1 2"}, "prompt_token_ids must be a list of int"),
    ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids must be a list of int"),
])
def test_bad_prompt_dicts_are_named_and_nothing_runs(llm: LLM, prompt: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, prompt], greedy(4))  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_a_prompt_of_another_type_is_a_type_error(llm: LLM) -> None:
    with pytest.raises(TypeError, match=r"^prompts\[1\] must be a string, .*got float"):
        llm.generate([PROMPT, 1.5], greedy(4))  # type: ignore[arg-type]


@pytest.mark.parametrize("prompts, message", [
    ("abc\ud800", r"^prompts\[0\] is not valid text: it contains a lone surrogate at position 3$"),
    ([PROMPT, {"prompt": "x\udfff"}], r"^prompts\[1\]\['prompt'\] is not valid text: .* at position 1$"),
    ([[1, 2.5]], r"^prompts\[0\] must be a list of int token ids, got \[1, 2.5\]"),
    ([[1, True]], r"^prompts\[0\] must be a list of int token ids"),
])
def test_a_prompt_that_is_no_text_or_token_ids_is_named_by_index(llm: LLM, prompts: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, greedy(4))
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_chat_text_that_is_no_text_is_named_by_place(llm: LLM) -> None:
    bad = [{"role": "user", "content": "hi\ud800"}]
    with pytest.raises(ValueError, match=r"^messages\[0\]\['content'\] is not valid text: .* at position 2$"):
        llm.chat(bad, greedy(2))
    with pytest.raises(ValueError, match=r"^messages\[1\]\[0\]\['content'\] is not valid text"):
        llm.chat([CHAT, bad], greedy(2))
    with pytest.raises(ValueError, match=r"^conversation\[0\]\['content'\] is not valid text"):
        llm.apply_chat_template(bad)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("params, error, message", [
    ({"temperature": 0.0}, TypeError, r"^sampling_params must be a SamplingParams or a list of them, got dict$"),
    ([greedy(2), {"max_tokens": 2}], TypeError, r"^sampling_params\[1\] must be a SamplingParams, got dict$"),
    ([greedy(2)] * 3, ValueError, r"^sampling_params has 3 entries for 2 prompts"),
    ("greedy", TypeError, r"^sampling_params must be a SamplingParams or a list of them, got str$"),
])
def test_sampling_params_of_another_type_or_count_are_refused(llm: LLM, params: Any, error: type[Exception],
                                                              message: str) -> None:
    with pytest.raises(error, match=message):
        llm.generate([PROMPT, PROMPT], params)
    with pytest.raises(error, match=message):
        llm.chat([CHAT, CHAT], params)
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


# ---- logprobs ----------------------------------------------------------------------------


def test_logprobs_are_ranked_logprob_objects(llm: LLM) -> None:
    [out] = llm.generate(PROMPT, greedy(6, logprobs=3))
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids) == 6
    tokenizer = llm.get_tokenizer()
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        assert next(iter(entry)) == token_id  # the sampled token first, as vLLM
        top = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert [lp.logprob for lp in top] == sorted((lp.logprob for lp in top), reverse=True)
        # greedy on raw logits: the sampled token is the most likely one
        assert entry[token_id].rank == 1
        assert entry[token_id].decoded_token == tokenizer.decode([token_id])
    expected = sum(entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob is not None
    assert math.isclose(completion.cumulative_logprob, expected) and completion.cumulative_logprob < 0


def test_a_sampled_token_outside_the_top_k_has_its_exact_rank(llm: LLM) -> None:
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=5.0, seed=3, max_tokens=24, ignore_eos=True, logprobs=1)
    [out] = llm.generate(PROMPT, params)
    completion = out.outputs[0]
    assert completion.logprobs is not None
    outside = [(t, entry) for t, entry in zip(completion.token_ids, completion.logprobs) if len(entry) == 2]
    assert outside, "at temperature 5 some sampled token should be outside the top 1"
    for token_id, entry in outside:
        better = [lp for t, lp in entry.items() if t != token_id]
        assert better[0].rank == 1 and entry[token_id].rank >= 2
        assert entry[token_id].logprob < better[0].logprob


def test_no_logprobs_asked_none_given(llm: LLM) -> None:
    [out] = llm.generate(PROMPT, greedy(4))
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    [zero] = llm.generate(PROMPT, greedy(4, logprobs=0))
    assert zero.outputs[0].logprobs is not None and all(len(e) == 1 for e in zero.outputs[0].logprobs)
    assert zero.outputs[0].cumulative_logprob is not None


# ---- chat --------------------------------------------------------------------------------


def test_chat_is_the_template_then_generate(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    [out] = llm.chat(CHAT, greedy(6))
    assert out.prompt == text
    assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False) == llm.apply_chat_template(CHAT)
    assert token_ids([out]) == token_ids(llm.generate({"prompt_token_ids": out.prompt_token_ids}, greedy(6)))
    both = llm.chat([CHAT, [*CHAT, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]],
                    greedy(3))
    assert len(both) == 2 and both[0].outputs[0].token_ids == out.outputs[0].token_ids[:3]


def test_chat_template_override_for_one_call(llm: LLM, tmp_path: Path) -> None:
    [out] = llm.chat(CHAT, greedy(2), chat_template=PLAIN)
    assert out.prompt == "user: hi\nassistant:"
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    [from_file] = llm.chat(CHAT, greedy(2), chat_template=str(path))
    assert from_file.prompt == out.prompt
    [default] = llm.chat(CHAT, greedy(2))  # the override was for that call only
    assert default.prompt is not None and default.prompt.startswith("<|im_start|>user")


def test_continue_final_message(llm: LLM) -> None:
    partial = [*CHAT, {"role": "assistant", "content": "The quick"}]
    [out] = llm.chat(partial, greedy(2), add_generation_prompt=False, continue_final_message=True)
    assert out.prompt is not None and out.prompt.endswith("<|im_start|>assistant\nThe quick")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt are not compatible"):
        llm.chat(partial, greedy(2), continue_final_message=True)


def test_tools_and_template_kwargs_reach_the_template(llm: LLM) -> None:
    template = ("{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{{ greeting }}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    [out] = llm.chat(CHAT, greedy(2), chat_template=template, tools=tools, add_generation_prompt=False,
                     chat_template_kwargs={"greeting": "hello:"})
    assert out.prompt == "[get_weather]hello:hi"
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        llm.chat(CHAT, greedy(2), chat_template_kwargs={"tokenize": True})
    with pytest.raises(TypeError, match="tools must be a list"):
        llm.chat(CHAT, greedy(2), tools={"name": "x"})  # type: ignore[arg-type]


def test_template_errors_are_value_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="could not format these messages: boom"):
        llm.chat(CHAT, greedy(2), chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(ValueError, match="chat_template is not a valid Jinja template"):
        llm.chat(CHAT, greedy(2), chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="there is no file 'missing/chat.jinja'"):
        llm.chat(CHAT, greedy(2), chat_template="missing/chat.jinja")
    assert_all_blocks_free(llm)


def test_no_template_is_a_clear_error() -> None:
    class Bare:
        chat_template = None

    with pytest.raises(ValueError, match="the model has no chat template"):
        render_chat(Bare(), CHAT)
    assert load_chat_template(CHATML) == CHATML
    assert load_chat_template("{% generation %}{{ x }}{% endgeneration %}")  # transformers' own tag parses


# ---- the chat_template engine option ------------------------------------------------------


def test_chat_template_engine_option(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    llm = LLM(str(tiny_model_dir), max_model_len=64, kv_cache_memory=1 << 20, chat_template=str(path))
    assert llm.get_tokenizer().chat_template == PLAIN
    [out] = llm.chat(CHAT, greedy(2))
    assert out.prompt == "user: hi\nassistant:"


@pytest.mark.parametrize("value, message", [
    ("templates/missing.jinja", "chat_template: there is no file"),
    ("chat.j2", "chat_template: there is no file"),
    ("{% if %}", "chat_template is not a valid Jinja template"),
])
def test_a_bad_chat_template_option_is_refused(tiny_model_dir: Path, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model_dir), max_model_len=64, kv_cache_memory=1 << 20, chat_template=value)


def test_chat_template_is_a_cli_flag() -> None:
    from specdec.cli import build_parser
    from specdec.engine_args import engine_kwargs

    args = build_parser().parse_args(["serve", "m", "--chat-template", "x.jinja"])
    assert engine_kwargs(args)["chat_template"] == "x.jinja"
