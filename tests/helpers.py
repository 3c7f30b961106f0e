"""Shared test helpers, one section per test folder: paged KV caches and attention
batches (kernels), whole-engine runs (engine), real HTTP servers over a tiny checkpoint
(server)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from torch import Tensor

from specdec.kernels import AttentionBackend, AttentionMetadata, PagedKV
from specdec.sampling_params import SamplingParams

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The Triton kernels' tests run on CPU tensors under the interpreter and, `cuda`-marked,
# compiled on a GPU (TRITON_INTERPRET=0 pytest -m cuda).
TRITON_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        INTERPRETED, reason="the compiled kernels: run with TRITON_INTERPRET=0")]),
]


def make_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    fill: float = 0.0,
) -> list[PagedKV]:
    """One PagedKV per layer, k and v each [num_blocks, block_size, Hkv, D].

    fill=nan makes any read of a slot nobody wrote show up in the output.
    """
    caches = [
        PagedKV.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype)
        for _ in range(num_layers)
    ]
    for cache in caches:
        for t in cache.tensors():
            t.fill_(fill)
    return caches


def random_block_table(
    num_tokens: int, block_size: int, num_blocks: int, seed: int = 0
) -> list[int]:
    """Distinct, shuffled block ids covering num_tokens (non-contiguous on purpose)."""
    needed = -(-num_tokens // block_size)
    if needed > num_blocks:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks, only {num_blocks} exist")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:needed].tolist()


def single_request_meta(
    prefix_len: int,
    q_len: int,
    block_table: list[int],
    block_size: int,
    tree_mask: Tensor | None = None,  # [q_len, q_len] bool, or None for causal
) -> AttentionMetadata:
    """Metadata for one request whose q_len new tokens follow prefix_len cached ones.

    The new tokens take context slots prefix_len .. prefix_len + q_len - 1.
    """
    seq_len = prefix_len + q_len
    if -(-seq_len // block_size) > len(block_table):
        raise ValueError(
            f"block table of {len(block_table)} blocks is too short for {seq_len} tokens"
        )
    slots = [
        block_table[p // block_size] * block_size + p % block_size
        for p in range(prefix_len, seq_len)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        query_lens_cpu=[q_len],
        seq_lens_cpu=[seq_len],
        tree_mask=tree_mask,
    )


def block_bytes(llm: Any) -> int:
    """Bytes of one 16-slot KV block of `llm`'s engine (every layer, K and V, its KV dtype)."""
    mc, config = llm.engine.model_config, llm.engine.config
    return 16 * mc.num_layers * PagedKV.bytes_per_slot(mc.num_kv_heads, mc.head_dim, config.kv_cache_torch_dtype)


# ---- whole-engine runs for tests/engine -------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def token_ids(outputs: Any) -> list[list[int]]:
    """The first completion's token ids of each RequestOutput."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_all_blocks_free(llm: Any) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def random_prompts(seed: int, count: int, vocab: int = 384) -> list[list[int]]:
    """Token-id prompts of noise then a repeated motif (the repeats give n-gram matches)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        prompts.append(noise + motif * rng.randint(1, 4))
    return prompts


def step_mixed(engine: Any, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Token ids of each prompt's request, stepped through `engine` together, every other
    request opting out of speculation."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, use_speculation=i % 2 == 0)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    return [list(finals[f"r{i}"]) for i in range(len(prompts))]


def greedy(max_tokens: int = 32, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- HTTP servers for tests/server -----------------------------------------------------------

API_KEY = "test-key"
MAX_MODEL_LEN = 128
NUM_BLOCKS = 64


@dataclass
class RunningServer:
    """uvicorn on 127.0.0.1 (a free port) in a background thread, in front of an AsyncEngine."""

    base_url: str
    model: str
    api_key: str | None
    async_engine: Any  # specdec.async_engine.AsyncEngine
    tokenizer: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def engine(self) -> Any:  # the LLMEngine
        return self.async_engine.engine

    def client(self, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        kwargs.setdefault("timeout", 30.0)
        return httpx.Client(base_url=self.base_url, headers=headers, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(model_dir: Path, name: str, api_key: str | None, **engine_args: Any) -> RunningServer:
    """A server for `model_dir` with a KV cache of NUM_BLOCKS blocks (small, so tests can fill it)."""
    from specdec.async_engine import AsyncEngine
    from specdec.llm import LLM
    from specdec.server.app import build_app

    block = 2 * 2 * 16 * 2 * 16 * 2  # K+V, 2 layers, 16 slots, 2 kv heads, head_dim 16, fp16 ("auto")
    llm = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory=NUM_BLOCKS * block, **engine_args)
    async_engine = AsyncEngine(llm.engine)
    app = build_app(async_engine, name, api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    url, thread = run_in_thread(server)
    return RunningServer(url, name, api_key, async_engine, llm.engine.tokenizer, server, thread)


def run_in_thread(server: uvicorn.Server) -> tuple[str, threading.Thread]:
    """Start `server` on a free 127.0.0.1 port in a daemon thread; its URL and the thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", thread


def wait_until(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


def slow_engine_steps(running: RunningServer, monkeypatch: Any, seconds: float = 0.01) -> None:
    """Make each engine step of the server take at least `seconds`, so requests stay in
    flight long enough for a test to act on them (monkeypatch: pytest's fixture)."""
    step = running.engine.step

    def slow_step() -> Any:
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(running.engine, "step", slow_step)


def all_blocks_free(running: RunningServer) -> bool:
    bm = running.engine.block_manager
    return bool(bm.num_free_blocks == bm.num_blocks)


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parsed `data:` payloads of an SSE stream; asserts it ends with [DONE]."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]", events[-3:]
    return events[:-1]


# ---- `specdec serve` subprocesses and concurrent streams for tests/server --------------------


@dataclass
class ServeProcess:
    """`specdec serve` in a child process on 127.0.0.1, its output in a log file (a pipe
    nobody reads could fill up and stall the server)."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# A `specdec serve` child of a CPU test runs on the CPU whatever GPU the machine has: the
# test process only patches torch.cuda.is_available (tests/conftest.py), which a child
# does not inherit.
CPU_DEVICE = ("--device", "cpu")


def start_serve_process(model_dir: Path, log: Path, *flags: str, timeout: float = 90.0,
                        device: str = "cpu") -> ServeProcess:
    """`specdec serve MODEL_DIR --served-model-name tiny --device DEVICE *flags`, healthy, or
    an AssertionError carrying its output."""
    port = free_port()
    command = [sys.executable, "-m", "specdec.cli", "serve", str(model_dir), "--host", "127.0.0.1", "--port",
               str(port), "--served-model-name", "tiny", "--device", device, *flags]
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    running = ServeProcess(proc, f"http://127.0.0.1:{port}", log)
    if not wait_until(lambda: _healthy(running), timeout=timeout, interval=0.1):
        running.kill()
        raise AssertionError(f"`specdec serve` did not become healthy:\n{running.output()}")
    return running


def _healthy(running: ServeProcess) -> bool:
    if running.proc.poll() is not None:
        raise AssertionError(f"`specdec serve` exited early:\n{running.output()}")
    try:
        return httpx.get(f"{running.url}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


class StreamReader(threading.Thread):
    """One streaming POST read to its end in a thread: the status, the non-empty lines, and
    `flowing` set once the first data line (or the end) has come."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.status: int | None = None
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.flowing = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=60.0) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.flowing.set()
        except BaseException as exc:  # noqa: BLE001 - handed to the test, which reports it
            self.error = exc
        finally:
            self.flowing.set()

    def events(self) -> list[Any]:
        """The parsed events before [DONE] (sse_events asserts the [DONE])."""
        assert self.error is None, repr(self.error)
        return sse_events(iter(self.lines))


def start_streams(url: str, body: dict[str, Any], count: int,
                  headers: dict[str, str] | None = None) -> list[StreamReader]:
    readers = [StreamReader(url, body, headers) for _ in range(count)]
    for reader in readers:
        reader.start()
    return readers


def serve_in_thread(model_dir: Path, *flags: str) -> RunningServer:
    """The server `specdec serve MODEL_DIR *flags` builds (app.make_server: its flags, its
    uvicorn settings, its drain), in a thread. Not being the main thread, it installs no
    signal handlers: a test calls `running.server.handle_exit(...)` as a signal would."""
    from specdec.async_engine import AsyncEngine
    from specdec.cli import build_parser
    from specdec.engine_args import engine_kwargs
    from specdec.llm import LLM
    from specdec.server.admission import resolve_api_key
    from specdec.server.app import make_server

    kv_bytes = NUM_BLOCKS * 2 * 2 * 16 * 2 * 16 * 2  # as start_server's
    args = build_parser().parse_args(["serve", str(model_dir), "--served-model-name", "tiny", "--max-model-len",
                                      str(MAX_MODEL_LEN), "--kv-cache-memory", str(kv_bytes), *flags])
    api_key = resolve_api_key(args.api_key, None)
    llm = LLM(args.model, **engine_kwargs(args))
    async_engine = AsyncEngine(llm.engine)
    server = make_server(args, async_engine, api_key)
    url, thread = run_in_thread(server)
    return RunningServer(url, "tiny", api_key, async_engine, llm.engine.tokenizer, server, thread)


# ---- attention batches for tests/kernels -----------------------------------------------------


def make_meta(
    specs: list[tuple[int, int]],  # (prefix_len, q_len) per request
    block_size: int,
    gen: torch.Generator,
    trees: list[Tensor] | None = None,  # per request [q_len, q_len] bool, or None
) -> tuple[AttentionMetadata, int]:
    """Metadata for the batch with randomly permuted block ids; also the block count."""
    seq_lens = [p + q for p, q in specs]
    n_blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(n_blocks) + 3  # spare blocks hold garbage nobody should read
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(specs), max(n_blocks), dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_blocks):
        tables[b, :n] = perm[used : used + n]
        used += n
    slots = [
        int(tables[b, pos // block_size]) * block_size + pos % block_size
        for b, (p, q) in enumerate(specs)
        for pos in range(p, p + q)
    ]
    q_lens = [q for _, q in specs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        tree_mask=None if trees is None else _stack_trees(trees, max(q_lens)),
    )
    return meta, num_blocks


def _stack_trees(trees: list[Tensor], width: int) -> Tensor:  # [T, width]
    # Padding columns are True so a kernel that reads past q_len gets caught.
    rows = [torch.cat([t, torch.ones(len(t), width - len(t), dtype=torch.bool)], 1) for t in trees]
    return torch.cat(rows)


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """Parent of each node; node 0 is the root (-1), parents precede children."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def tree_mask_from_parents(parents: list[int]) -> Tensor:  # [n, n] bool
    """Row i marks node i and all its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_trees(specs: list[tuple[int, int]], gen: torch.Generator) -> list[Tensor]:
    return [tree_mask_from_parents(random_parents(q, gen)) for _, q in specs]


def random_masks(specs: list[tuple[int, int]], gen: torch.Generator) -> list[Tensor]:
    """Per request a [q_len, q_len] mask that is no tree: each token sees itself and a
    random half of the others."""
    masks = [torch.rand(q, q, generator=gen) < 0.5 for _, q in specs]
    for mask in masks:
        mask.fill_diagonal_(True)
    return masks


def random_inputs(
    meta: AttentionMetadata, num_blocks: int, block_size: int, hq: int, hkv: int, d: int,
    gen: torch.Generator, dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, PagedKV]:
    """Query [T, Hq, D] and caches filled with noise everywhere, query K/V included."""
    num_tokens = int(meta.query_start_loc[-1])
    q = torch.randn(num_tokens, hq, d, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    return q, PagedKV(k_cache, v_cache)


def attend(backend: AttentionBackend[Any], query: Tensor, kv: PagedKV, meta: AttentionMetadata,
           scale: float) -> Tensor:  # [T, Hq, D] -> [T, Hq, D]
    """One layer's attention through `backend`, planned for this step."""
    return backend.forward(query, kv, backend.plan(meta, kv), scale)


def store(backend: AttentionBackend[Any], key: Tensor, value: Tensor, kv: PagedKV,
          meta: AttentionMetadata) -> None:  # key, value: [T, Hkv, D]
    """One layer's K/V store through `backend` at meta's slots."""
    backend.store_kv(key, value, kv, backend.plan(meta, kv))


# ---- request limits and error logs for tests/server ------------------------------------------


def app_state(running: RunningServer) -> Any:
    """The ServerState of a test server's app: its limits and its tokenizer thread."""
    from fastapi import FastAPI

    app = running.server.config.app
    assert isinstance(app, FastAPI)  # build_app's, in every RunningServer
    return app.state.server


@contextlib.contextmanager
def logged_errors() -> Iterator[list[logging.LogRecord]]:
    """Records at ERROR or with a traceback, from the root logger and uvicorn's, meanwhile."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR or record.exc_info:
                records.append(record)

    handler = Collect()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
