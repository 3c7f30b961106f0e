"""The server on a GPU, driven by the official openai client: `specdec serve --device cuda` in
a child process (the model's dtype, CUDA graphs, compiled Triton kernels, the hybrid drafter's
trees), answering completions and chats, streamed or not, batched or one at a time,
speculative or plain, free or under a JSON schema, with the same tokens either way.

`cuda`-marked: skipped without a GPU (tests/conftest.py). On a GPU:
TRITON_INTERPRET=0 .venv/bin/python -m pytest -m cuda tests
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from tests.helpers import ServeProcess, start_serve_process

pytestmark = pytest.mark.cuda

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return a + b\n" * 3, "1 2 3 4 5 6 7 8", "Once upon a time"]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 24}
CHAT = [{"role": "user", "content": "Give me a person as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def cuda_server(tiny_model_dir: Path, tiny_recurrent_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from specdec.kernels import attention_triton

    if type(attention_triton._paged_attention_kernel).__name__ == "InterpretedFunction":
        pytest.skip("Triton runs interpreted in this session (and so would the server); on a GPU run "
                    "TRITON_INTERPRET=0 pytest -m cuda tests")
    spec = {"method": "hybrid", "model": str(tiny_recurrent_dir), "num_speculative_tokens": 4, "num_tree_nodes": 8}
    log = tmp_path_factory.mktemp("cuda-serve") / "serve.log"
    running = start_serve_process(tiny_model_dir, log, "--max-model-len", "256", "--max-num-seqs", "8",
                                  "--kv-cache-memory", str(1 << 24), "--speculative-config", json.dumps(spec),
                                  device="cuda", timeout=300.0)
    yield running
    running.kill()


@pytest.fixture
def oai(cuda_server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cuda_server.url}/v1", api_key="unused", max_retries=0, timeout=120.0)


def complete(oai: openai.OpenAI, prompt: str, speculative: bool = True) -> str:
    reply = oai.completions.create(model="tiny", prompt=prompt, **GREEDY,
                                   extra_body={"ignore_eos": True, "speculative": speculative})
    assert reply.usage is not None and reply.usage.completion_tokens == GREEDY["max_tokens"]
    return reply.choices[0].text


def test_the_server_runs_on_the_gpu_in_graphs(cuda_server: ServeProcess, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list()] == ["tiny"]
    ready = next(line for line in cuda_server.output().splitlines() if "ready: model tiny" in line)
    assert "device cuda" in ready and "attention backend triton" in ready and "dtype float32" not in ready


def test_speculation_changes_no_token(oai: openai.OpenAI, cuda_server: ServeProcess) -> None:
    drafts_before = spec_drafts(cuda_server)
    for prompt in PROMPTS:
        assert complete(oai, prompt, speculative=True) == complete(oai, prompt, speculative=False), prompt
    assert spec_drafts(cuda_server) > drafts_before


def test_streamed_equals_whole(oai: openai.OpenAI) -> None:
    whole = complete(oai, PROMPTS[1])
    pieces = oai.completions.create(model="tiny", prompt=PROMPTS[1], stream=True, **GREEDY,
                                    extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in pieces if c.choices) == whole


def test_concurrent_requests_equal_one_at_a_time(oai: openai.OpenAI) -> None:
    """Batched verify steps (and the graphs of several requests) give each request the
    tokens it gets alone."""
    alone = [complete(oai, prompt) for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        together = list(pool.map(lambda prompt: complete(oai, prompt), PROMPTS * 2))
    assert together == alone * 2


def test_chat_streamed_equals_whole(oai: openai.OpenAI) -> None:
    messages = cast(Any, CHAT)
    chat = oai.chat.completions.create(model="tiny", messages=messages, **GREEDY, extra_body={"ignore_eos": True})
    events = oai.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(events)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]


def test_a_json_schema_holds_on_the_gpu_and_speculation_changes_nothing(oai: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    texts = []
    for speculative in (True, False):
        reply = oai.chat.completions.create(model="tiny", messages=cast(Any, CHAT), temperature=0.0, max_tokens=80,
                                            response_format=cast(Any, response_format),
                                            extra_body={"speculative": speculative})
        assert reply.choices[0].finish_reason == "stop"
        texts.append(reply.choices[0].message.content)
    assert texts[0] == texts[1]
    Person.model_validate_json(cast(str, texts[0]))


def spec_drafts(server: ServeProcess) -> float:
    page = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    return sum(sample.value for family in text_string_to_metric_families(page) for sample in family.samples
               if sample.name == "specdec:spec_decode_num_drafts_total")
