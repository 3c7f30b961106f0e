"""The OpenAI-compatible routes on a real server: shapes, streaming, usage, n, stop,
logprobs, echo, chat, per-request speculation (httpx and the official openai client)."""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, cast

import httpx
import openai
import pytest

from tests.helpers import RunningServer, all_blocks_free, sse_events, wait_until

PROMPT = "The quick brown fox"
REPETITIVE = "def add(a, b):\n    return a + b\n" * 3  # n-gram lookup finds drafts here
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a capital city."}]


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", **body}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def stream(client: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={"model": "tiny", "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def joined(chunks: list[dict[str, Any]], key: str = "text") -> dict[int, str]:
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        for choice in chunk["choices"]:
            part = choice[key] if key == "text" else choice["delta"].get("content") or ""
            texts[choice["index"]] += part
    return dict(texts)


def finish_reasons(chunks: list[dict[str, Any]]) -> dict[int, list[str]]:
    reasons: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["finish_reason"] is not None:
                reasons[choice["index"]].append(choice["finish_reason"])
    return dict(reasons)


def test_completion_shape_and_usage(server: RunningServer, client: httpx.Client) -> None:
    body = complete(client, prompt=PROMPT, **GREEDY)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(server.tokenizer.encode(PROMPT))
    assert usage["completion_tokens"] == GREEDY["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("prompt", [PROMPT, REPETITIVE])
def test_streamed_text_equals_non_streamed(client: httpx.Client, prompt: str) -> None:
    full = complete(client, prompt=prompt, **GREEDY)
    chunks = stream(client, "/v1/completions", prompt=prompt, stream_options={"include_usage": True}, **GREEDY)
    *content, usage_chunk = chunks
    assert joined(content) == {0: full["choices"][0]["text"]}
    assert finish_reasons(content) == {0: ["length"]}
    assert content[-1]["choices"][0]["finish_reason"] == "length"  # in the last content chunk
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    assert all(c["id"] == content[0]["id"] and c["object"] == "text_completion" for c in chunks)


def test_token_id_prompts_and_batches(server: RunningServer, client: httpx.Client) -> None:
    ids = server.tokenizer.encode(PROMPT)
    by_text = complete(client, prompt=PROMPT, **GREEDY)["choices"][0]["text"]
    assert complete(client, prompt=ids, **GREEDY)["choices"][0]["text"] == by_text
    batch = complete(client, prompt=[PROMPT, "Paris"], **GREEDY)
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][0]["text"] == by_text
    assert batch["usage"]["prompt_tokens"] == len(ids) + len(server.tokenizer.encode("Paris"))
    both = complete(client, prompt=[ids, ids], **GREEDY)
    assert [c["text"] for c in both["choices"]] == [by_text, by_text]


def test_n_choices(client: httpx.Client) -> None:
    sampled = {"prompt": PROMPT, "temperature": 0.9, "seed": 7, "max_tokens": 8, "ignore_eos": True, "n": 2}
    body = complete(client, **sampled)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 16
    assert complete(client, **sampled)["choices"] == body["choices"]  # seeded: reproducible
    greedy = complete(client, prompt=PROMPT, n=2, **GREEDY)
    chunks = stream(client, "/v1/completions", prompt=PROMPT, n=2, **GREEDY)
    assert joined(chunks) == {c["index"]: c["text"] for c in greedy["choices"]}
    assert finish_reasons(chunks) == {0: ["length"], 1: ["length"]}


def test_stop_strings(client: httpx.Client) -> None:
    full = complete(client, prompt=PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    stop = full[6:9]
    expected = full[: full.find(stop)]
    body = complete(client, prompt=PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop, "@@@"])
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = stream(client, "/v1/completions", prompt=PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True,
                    stop=stop)
    assert joined(chunks) == {0: expected} and finish_reasons(chunks) == {0: ["stop"]}


def test_completion_logprobs(client: httpx.Client) -> None:
    body = complete(client, prompt=PROMPT, logprobs=2, **GREEDY)
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    num = body["usage"]["completion_tokens"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == num
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0
    for lp, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert lp <= 0.0 and 2 <= len(top) <= 3
        assert lp == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the top one
    chunks = stream(client, "/v1/completions", prompt=PROMPT, logprobs=2, **GREEDY)
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == logprobs["tokens"]


def test_echo(client: httpx.Client) -> None:
    plain = complete(client, prompt=PROMPT, **GREEDY)["choices"][0]["text"]
    body = complete(client, prompt=PROMPT, echo=True, **GREEDY)
    assert body["choices"][0]["text"] == PROMPT + plain
    chunks = stream(client, "/v1/completions", prompt=PROMPT, echo=True, **GREEDY)
    assert joined(chunks) == {0: PROMPT + plain}


def test_chat_with_template(server: RunningServer, client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, **GREEDY})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    text = server.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    prompt_ids = server.tokenizer.encode(text, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    tokenized = client.post("/tokenize", json={"model": "tiny", "messages": CHAT}).json()
    assert tokenized["tokens"] == prompt_ids
    chunks = stream(client, "/v1/chat/completions", messages=CHAT, **GREEDY)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert joined(chunks, key="delta") == {0: choice["message"]["content"]}
    assert finish_reasons(chunks) == {0: ["length"]}
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "city."}]}]
    assert client.post("/v1/chat/completions", json={"messages": parts, **GREEDY}).status_code == 200


def test_chat_logprobs(client: httpx.Client) -> None:
    request = {"model": "tiny", "messages": CHAT, "logprobs": True, "top_logprobs": 2, **GREEDY}
    body = client.post("/v1/chat/completions", json=request).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"], abs=1e-5)
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
    no_top = client.post("/v1/chat/completions", json={**request, "top_logprobs": None}).json()
    assert all(item["top_logprobs"] == [] for item in no_top["choices"][0]["logprobs"]["content"])


def test_speculation_switch_is_lossless(server: RunningServer, client: httpx.Client) -> None:
    before = server.async_engine.stats["num_drafts"]
    with_spec = complete(client, prompt=REPETITIVE, speculative=True, **GREEDY)
    assert wait_until(lambda: server.async_engine.stats["num_drafts"] > before)
    drafts = server.async_engine.stats["num_drafts"]
    without = complete(client, prompt=REPETITIVE, speculative=False, **GREEDY)
    assert without["choices"][0]["text"] == with_spec["choices"][0]["text"]
    assert server.async_engine.stats["num_drafts"] == drafts  # plain decoding drafted nothing
    chat_on = client.post("/v1/chat/completions", json={"messages": CHAT, **GREEDY}).json()
    chat_off = client.post("/v1/chat/completions", json={"messages": CHAT, "speculative": False, **GREEDY}).json()
    assert chat_on["choices"][0]["message"] == chat_off["choices"][0]["message"]
    assert wait_until(lambda: all_blocks_free(server))


def test_models_health_tokenize(server: RunningServer, client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert client.get("/health").status_code == 200
    tokens = client.post("/tokenize", json={"model": "tiny", "prompt": "héllo wörld"}).json()
    assert tokens["tokens"] == server.tokenizer.encode("héllo wörld")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 128
    text = client.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "héllo wörld"}


def test_openai_client(server: RunningServer) -> None:
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0)
    assert [m.id for m in oai.models.list()] == ["tiny"]
    completion = oai.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=12,
                                        extra_body={"ignore_eos": True})
    pieces = oai.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=12, stream=True,
                                    extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in pieces if c.choices) == completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    chat = oai.chat.completions.create(model="tiny", messages=cast(Any, CHAT), temperature=0, max_tokens=12,
                                       extra_body={"ignore_eos": True, "speculative": False})
    events = oai.chat.completions.create(model="tiny", messages=cast(Any, CHAT), temperature=0, max_tokens=12,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(events)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert chat.usage is not None and chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=-1)
    assert "temperature" in str(info.value)
    bad_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_sse_event_survives_unicode_line_breaks() -> None:
    """U+0085, U+2028 and U+2029 stay escaped: clients splitting the stream with
    str.splitlines (httpx's aiter_lines) must see one `data:` line per event."""
    from specdec.server.streaming import sse

    text = "a\u2028b\x85c\u2029d\u00e9"
    lines = sse({"delta": {"content": text}}).splitlines()
    assert len(lines) == 2 and lines[0].startswith("data: ") and lines[1] == ""
    assert json.loads(lines[0][len("data: "):])["delta"]["content"] == text
