"""Engine replicas on Ray Serve (server/ray_*.py, asgi_relay.py).

The first tests need no cluster: prefix keys, the router's choices, the ingress's retry
and mid-stream failure, the relay's disconnect, the metrics merge, the refused flags.
The rest share one local Ray cluster (2 CPUs) and one application of 2 replicas of the
tiny checkpoint with prefix caching, deployed from `specdec serve` flags; the last test
shuts it down and checks no Ray process is left.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorDiedError
from ray.serve import Application
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, ReplicaState
from starlette.types import Receive, Scope, Send

from specdec.cli import build_parser, main
from specdec.server import ray_launch
from specdec.server.asgi_relay import ForwardedRequest, ResponseHead, relay
from specdec.server.ray_app import Scaling, app_builder, engine_value
from specdec.server.ray_ingress import respond
from specdec.server.ray_metrics import merge_pages
from specdec.server.ray_replica import REPLICA_HEADER
from specdec.server.ray_router import CHUNK_CHARS, PrefixAffinityRouter, prefix_keys
from specdec.server.streaming import sse
from tests.helpers import free_port, sse_events, start_streams, wait_until

MODEL = "tiny"
PREFIX = "The quick brown fox jumps over the lazy dog. " * 4  # ~76 tokens: 4 full KV blocks
SSE_HEAD = ResponseHead(200, ((b"content-type", b"text/event-stream"),))


# ---- no cluster --------------------------------------------------------------------------------


def test_prefix_keys_follow_a_conversation_and_a_shared_prefix() -> None:
    turn = [{"role": "user", "content": "hello"}]
    later = [*turn, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    assert prefix_keys({"messages": later})[:1] == prefix_keys({"messages": turn})
    first, second = prefix_keys({"prompt": PREFIX + "one"}), prefix_keys({"prompt": PREFIX + "two"})
    shared = len(PREFIX) // CHUNK_CHARS
    assert first[:shared] == second[:shared] and first[shared:] != second[shared:]
    assert prefix_keys({"prompt": [PREFIX + "one", "x"]}) == first  # a batch follows its first prompt
    assert prefix_keys({"prompt": "abc"}) != prefix_keys({"prompt": "abd"})
    assert prefix_keys(None) == () and prefix_keys({"model": "tiny"}) == ()


def _router(threshold: int) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DeploymentID(name="EngineReplica", app_name="test"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(imbalance_threshold=threshold)
    return router


def _pending(request_id: str, body: Any = None) -> Any:
    request = ForwardedRequest("POST", "/v1/completions", prefix_keys=prefix_keys(body))
    return SimpleNamespace(args=[request], metadata=SimpleNamespace(internal_request_id=request_id),
                           future=Future())


# The router reads only a replica's `replica_id`, which it hashes and compares: strings stand
# in for Serve's ReplicaIDs, and namespaces holding them for its RunningReplicas.
A, B = cast(ReplicaID, "a"), cast(ReplicaID, "b")


def _replicas() -> tuple[Any, Any]:
    return SimpleNamespace(replica_id=A), SimpleNamespace(replica_id=B)


def _choice(router: PrefixAffinityRouter, replicas: list[Any], body: Any = None) -> Any:
    """The replica ranked first, without routing anything (choose_replicas counts its request there)."""
    ranks = router.rank(replicas, prefix_keys(body))
    assert sorted((r.replica_id for r in ranks), key=str) == sorted((r.replica_id for r in replicas), key=str)
    return ranks[0]


def test_router_prefers_the_prefix_until_its_replica_is_busier() -> None:
    router = _router(threshold=1)
    a, b = _replicas()
    body = {"prompt": PREFIX + "first"}
    router.on_request_routed(_pending("1", body), A, None)
    assert _choice(router, [b, a], {"prompt": PREFIX + "second"}) is a  # one more in flight: within 1
    router.on_request_routed(_pending("2"), A, None)
    assert _choice(router, [a, b], {"prompt": PREFIX + "second"}) is b  # two more: the shortest queue wins
    router.on_request_completed(A, "2")
    router.on_request_completed(A, "1")
    assert _choice(router, [b, a], {"prompt": PREFIX + "second"}) is a
    assert _choice(router, [a, b], {"prompt": "a prompt nobody sent"}) is b  # b holds fewer prefixes
    router.on_request_completed(A, "unknown")  # a request routed elsewhere (or twice) changes nothing
    assert router.in_flight[A] == 0


def test_a_burst_sharing_a_prefix_is_counted_as_each_request_is_chosen() -> None:
    threshold = 4
    router = _router(threshold)
    a, b = _replicas()
    router.on_request_routed(_pending("earlier", {"prompt": PREFIX + "earlier"}), A, None)
    router.on_request_completed(A, "earlier")  # a holds the prefix, nothing is in flight
    burst = [_pending(f"burst-{i}", {"prompt": f"{PREFIX}Question {i}?"}) for i in range(8)]

    async def choose(request: Any) -> ReplicaID:
        return (await router.choose_replicas([a, b], request))[0][0].replica_id

    async def arrive_at_once() -> list[ReplicaID]:  # Serve reports none routed before all are chosen
        return list(await asyncio.gather(*(choose(request) for request in burst)))

    chosen = asyncio.run(arrive_at_once())
    for i, replica in enumerate(chosen):  # the rule, on what was really sent before each choice
        load = Counter(chosen[:i])
        assert load[replica] <= min(load[A], load[B]) + threshold, chosen
    # the sixth is the first the rule sends away; the prefix then follows it to b, its last choice
    assert chosen == ["a"] * 5 + ["b"] * 3
    assert (router.in_flight[A], router.in_flight[B]) == (5, 3)
    router.on_request_routed(burst[0], B, None)  # Serve took the second rank: a was full
    assert (router.in_flight[A], router.in_flight[B]) == (4, 4)
    for request, replica in zip(burst, [B, *chosen[1:]], strict=True):
        router.on_request_completed(replica, request.metadata.internal_request_id)
    assert not router.in_flight and not router.routed and not router.unsent


def test_requests_that_fail_or_are_cancelled_before_routing_are_released() -> None:
    router = _router(threshold=4)
    a, b = _replicas()
    cancelled, rejected = _pending("cancelled"), _pending("rejected")
    assert asyncio.run(router.choose_replicas([a, b], cancelled))[0][0] is a
    assert asyncio.run(router.choose_replicas([a, b], rejected))[0][0] is b
    cancelled.future.cancel()  # the client left while the request waited for a replica
    assert asyncio.run(router.choose_replicas([a, b], rejected))[0][0] is a  # a retry: b's count moved to a
    assert dict(router.in_flight) == {"a": 1}
    router.on_request_completed(B, "rejected")  # the first try's callback, late: the retry's count stays
    assert dict(router.in_flight) == {"a": 1}
    router.on_request_completed(A, "rejected")  # the retry failed on the replica
    assert not router.in_flight and not router.routed and not router.unsent


def _fake_replica(*parts: Any) -> Any:
    """A Call whose replica sends `parts` (an exception in them: the replica dies there)."""

    async def call(request: ForwardedRequest) -> AsyncIterator[Any]:
        for part in parts:
            if isinstance(part, BaseException):
                raise part
            yield part

    return call


def _respond(call: Any, request: ForwardedRequest) -> tuple[int, bytes]:
    """The ingress's status and whole body (one event loop: asyncio.run closes generators)."""

    async def run() -> tuple[int, bytes]:
        response = await respond(call, request)
        if not hasattr(response, "body_iterator"):
            return response.status_code, bytes(response.body)
        return response.status_code, b"".join([chunk async for chunk in response.body_iterator])

    return asyncio.run(run())


def test_a_replica_that_dies_before_answering_is_retried_elsewhere() -> None:
    calls = [_fake_replica(ActorDiedError()),
             _fake_replica(ResponseHead(200, ((b"content-type", b"application/json"),)), b'{"ok"', b": 1}")]
    status, body = _respond(lambda request: calls.pop(0)(request), ForwardedRequest("POST", "/v1/completions"))
    assert status == 200 and body == b'{"ok": 1}' and not calls


def test_a_replica_that_dies_mid_stream_ends_it_with_an_error_event() -> None:
    call = _fake_replica(SSE_HEAD, b'data: {"choices": []}\n\n', ActorDiedError())
    status, body = _respond(call, ForwardedRequest("POST", "/v1/completions"))
    events = sse_events(iter(body.decode().splitlines()))
    assert status == 200 and events[0] == {"choices": []}
    assert events[1]["error"]["code"] == "replica_died" and "replica" in events[1]["error"]["message"]


def _chunk_events(head: dict[str, Any], *choices: dict[str, Any]) -> bytes:
    return "".join(sse({**head, "choices": [choice]}) for choice in choices).encode()


def test_a_replica_death_mid_stream_ends_each_unfinished_completion_choice_with_abort() -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
    data = _chunk_events(head, {"index": 0, "text": "a", "logprobs": None, "finish_reason": None},
                         {"index": 1, "text": "b", "logprobs": None, "finish_reason": "length"})
    call = _fake_replica(SSE_HEAD, data[:10], data[10:-5], data[-5:], ActorDiedError())  # events cut anywhere
    body = json.dumps({"model": MODEL, "prompt": ["x", "y"], "n": 2, "stream": True}).encode()
    status, raw = _respond(call, ForwardedRequest("POST", "/v1/completions", body=body))
    events = sse_events(iter(raw.decode().splitlines()))
    abort = {"text": "", "logprobs": None, "finish_reason": "abort"}
    # choices 2 and 3 (the second prompt's) had sent nothing: they end too
    assert status == 200 and events[2:5] == [{**head, "choices": [{"index": i, **abort}]} for i in (0, 2, 3)]
    assert len(events) == 6 and events[5]["error"]["code"] == "replica_died"


def test_a_replica_death_mid_stream_ends_each_unfinished_chat_choice_with_abort() -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "usage": None}
    data = _chunk_events(head, *({"index": i, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}
                                 for i in (0, 1)), {"index": 1, "delta": {"content": "hi"}, "logprobs": None,
                                                    "finish_reason": None})
    call = _fake_replica(SSE_HEAD, data, b": keep-alive\n\n", ActorDiedError())
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}).encode()
    status, raw = _respond(call, ForwardedRequest("POST", "/v1/chat/completions", body=body))
    events = sse_events(line for line in raw.decode().splitlines() if not line.startswith(":"))
    abort: dict[str, Any] = {"delta": {}, "logprobs": None, "finish_reason": "abort"}
    assert status == 200 and events[3:5] == [{**head, "choices": [{"index": i, **abort}]} for i in (0, 1)]
    assert len(events) == 6 and events[5]["error"]["code"] == "replica_died"


def test_relay_streams_and_tells_the_app_when_the_client_goes() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        assert (await receive())["type"] == "http.request"
        try:
            for i in range(1000):
                await send({"type": "http.response.body", "body": b"%d," % i, "more_body": True})
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def first_parts() -> list[Any]:
        # relay is an async generator (annotated as an AsyncIterator): it can be closed.
        parts = cast("AsyncGenerator[ResponseHead | bytes, None]",
                     relay(app, ForwardedRequest("GET", "/"), {}, ((b"x-test", b"1"),)))
        got = [await anext(parts), await anext(parts)]
        await parts.aclose()
        return got

    head, chunk = asyncio.run(first_parts())
    assert head.status == 200 and head.header(b"x-test") == b"1" and chunk.startswith(b"0,")
    assert seen == ["cancelled"]


def test_merged_metrics_label_each_replica_once_per_metric() -> None:
    page = "# HELP specdec:x_total X.\n# TYPE specdec:x_total counter\nspecdec:x_total 3.0\n"
    merged = merge_pages({"r1": page, "r2": page.replace("3.0", "4.0")})
    assert merged.count("# TYPE specdec:x_total counter") == 1
    samples = [s for f in text_string_to_metric_families(merged) for s in f.samples]
    assert {(s.name, s.labels["replica"], s.value) for s in samples} == {("specdec:x_total", "r1", 3.0),
                                                                         ("specdec:x_total", "r2", 4.0)}


def test_flags_ray_cannot_honour_are_refused(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tiny_model_dir), "--data-parallel-size", "2", "--max-concurrent-requests-per-key", "2"])
    assert exit_info.value.code == 2 and "--max-concurrent-requests-per-key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_model_dir), "--min-replicas", "3", "--max-replicas", "2"])
    assert "--min-replicas (3) is above --max-replicas (2)" in capsys.readouterr().err
    assert not ray.is_initialized()  # refused before any cluster started


def test_autoscaling_flags_become_serves_autoscaling_config() -> None:
    args = build_parser().parse_args(["serve", "--data-parallel-size", "3", "--max-replicas", "4",
                                      "--target-ongoing-requests", "8"])
    assert ray_launch.scaling(args).deployment_options() == {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 3, "target_ongoing_requests": 8.0}}
    assert Scaling(num_replicas=2).deployment_options() == {"num_replicas": 2}
    assert Scaling(num_replicas=1, min_replicas=2).initial_replicas == 2


def test_serve_run_arguments_are_typed_and_unknown_ones_refused(tiny_model_dir: Path) -> None:
    assert engine_value("max_model_len", "256") == 256
    assert engine_value("enable_prefix_caching", "true") is True
    assert engine_value("kv_cache_dtype", "fp16") == "fp16"
    with pytest.raises(ValueError, match="must be true or false"):
        engine_value("enable_prefix_caching", "yes please")
    assert isinstance(app_builder({"model": str(tiny_model_dir), "data_parallel_size": "3"}), Application)
    with pytest.raises(ValueError, match="unknown argument 'replicas'"):
        app_builder({"model": str(tiny_model_dir), "replicas": "3"})


# ---- one cluster, one application ---------------------------------------------------------------


@dataclass
class RayApp:
    url: str
    args: Any

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0)


@pytest.fixture(scope="module")
def ray_app(tiny_model_dir: Path) -> Iterator[RayApp]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    args = build_parser().parse_args([
        "serve", str(tiny_model_dir), "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(free_port()),
        "--data-parallel-size", "2", "--max-model-len", "512", "--enable-prefix-caching", "--stats-interval", "0",
        "--device", "cpu",  # replicas are other processes: the test's CPU patch does not reach them
    ])
    try:
        yield RayApp(ray_launch.deploy(args, None), args)
    finally:
        ray_launch.stop(local=True)


def _complete(client: httpx.Client, prompt: str, max_tokens: int = 8) -> tuple[str, str]:
    """The completion's text and the replica that answered."""
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], response.headers[REPLICA_HEADER.decode()]


def _metric(page: str, name: str) -> dict[str, float]:
    """The samples of one metric by replica."""
    return {s.labels["replica"]: s.value for f in text_string_to_metric_families(page) for s in f.samples
            if s.name == name}


def test_requests_are_spread_across_both_replicas(ray_app: RayApp) -> None:
    with ray_app.client() as client:
        replicas = {_complete(client, f"{i} distinct prompt {i}")[1] for i in range(6)}
    assert len(replicas) == 2


def test_streaming_through_the_ingress_matches_the_whole_response(ray_app: RayApp) -> None:
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with ray_app.client() as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response.iter_lines())
        whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_greedy_outputs_equal_a_single_engines(ray_app: RayApp, tiny_model_dir: Path) -> None:
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    prompts = ["hello there", "one two three four", PREFIX, "a different start"]
    llm = LLM(str(tiny_model_dir), max_model_len=512, enable_prefix_caching=True)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                                                  ignore_eos=True))]
    with ray_app.client() as client:
        assert [_complete(client, prompt, max_tokens=16)[0] for prompt in prompts] == expected


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(ray_app: RayApp) -> None:
    with ray_app.client() as client:
        replicas = {_complete(client, f"{PREFIX}Question {i}?")[1] for i in range(4)}
        assert len(replicas) == 1
        (replica,) = replicas
        assert wait_until(lambda: _metric(client.get("/metrics").text, "specdec:prefix_cache_hits_total")
                          .get(replica, 0) >= 3 * 64, timeout=15)  # 4 blocks of 16 tokens, three times


def test_a_conversation_keeps_its_replica(ray_app: RayApp) -> None:
    with ray_app.client() as client:
        for topic in ("apples", "boats", "clouds"):
            turns = [{"role": "user", "content": f"Tell me about {topic}."}]
            first = client.post("/v1/chat/completions", json={"model": MODEL, "messages": turns, "max_tokens": 6})
            turns += [first.json()["choices"][0]["message"], {"role": "user", "content": "And then?"}]
            second = client.post("/v1/chat/completions", json={"model": MODEL, "messages": turns, "max_tokens": 6})
            assert second.status_code == 200
            assert second.headers[REPLICA_HEADER.decode()] == first.headers[REPLICA_HEADER.decode()]


def test_metrics_carry_a_replica_label_and_keep_their_names(ray_app: RayApp) -> None:
    with ray_app.client() as client:
        assert wait_until(lambda: len(_metric(client.get("/metrics").text, "specdec:prompt_tokens_total")) == 2,
                          timeout=15)
        page = client.get("/metrics").text
    assert len(_metric(page, "vllm:prompt_tokens_total")) == 2
    assert len(_metric(page, "specdec:num_requests_running")) == 2


def _replica_actors() -> dict[str, str]:
    """Replica id -> actor name of the live EngineReplica actors."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    return {name.rsplit("#", 1)[1]: name for name in names if "#EngineReplica#" in name}


def _running_replicas() -> int:
    deployment = serve.status().applications[ray_launch.APP_NAME].deployments["EngineReplica"]
    return int(deployment.replica_states.get(ReplicaState.RUNNING, 0))


def test_a_killed_replica_is_replaced_while_the_other_serves(ray_app: RayApp) -> None:
    before = _replica_actors()
    assert len(before) == 2
    prompt = "a long stream " * 8
    with ray_app.client() as client:
        victim = _complete(client, prompt)[1]  # the streams' prompt is cached there: they go there too
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    streams = start_streams(f"{ray_app.url}/v1/completions", body, 4)
    assert all(stream.flowing.wait(30) for stream in streams)
    ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
    with ray_app.client() as client:
        assert all(_complete(client, f"after the kill {i}")[1] != victim for i in range(4))
    ends = []
    for stream in streams:
        stream.join(60)
        ends.append(stream.events()[-1])  # events() checks the stream ended with [DONE]
    assert all("error" in end or end["choices"][0]["finish_reason"] == "length" for end in ends), ends
    for stream in streams:  # each cut stream ended its choice with "abort" before the error event
        events = stream.events()
        if "error" in events[-1]:
            assert events[-2]["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort"}]
    # 400 tokens take far longer than the kill: the streams on the victim were cut short
    assert any(end.get("error", {}).get("code") == "replica_died" for end in ends), ends
    assert wait_until(lambda: len(set(_replica_actors()) - set(before)) == 1 and _running_replicas() == 2,
                      timeout=120, interval=0.5)
    (newcomer,) = set(_replica_actors()) - set(before)
    with ray_app.client() as client:  # a new prompt goes to the replica holding the fewest prefixes
        assert wait_until(lambda: _complete(client, f"for the newcomer {time.monotonic()}")[1] == newcomer,
                          timeout=30, interval=0.2)


def _descendants() -> set[int]:
    """Process ids of this process's children, their children, and so on (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_shutdown_leaves_no_ray_process_behind(ray_app: RayApp) -> None:
    ray_processes = _descendants()
    assert len(ray_processes) >= 5  # gcs, raylet, controller, proxy, replicas
    ray_launch.stop(local=True)
    assert wait_until(lambda: not any(_alive(pid) for pid in ray_processes), timeout=30, interval=0.2), \
        [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in ray_processes if _alive(pid)]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{ray_app.url}/health", timeout=2.0)

