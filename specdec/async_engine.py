"""An asyncio front for LLMEngine: one background thread owns the engine.

The engine is not thread-safe, so every engine call (add_request, abort_request, step,
get_metrics) happens in a single loop thread. The event loop hands commands to that
thread through a thread-safe queue; the thread hands each step's outputs back to the
event loop with `loop.call_soon_threadsafe`, where each request keeps only its newest one. When no request is in
flight the thread sleeps on the command queue (no busy spinning).

A request with n > 1 fans out into child requests (specdec.parallel_sampling, as in
`LLM`); its stream merges them back into one RequestOutput with n completions.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from specdec.faults import STEP_FAILED
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.parallel_sampling import ParentRequest, Prompt
from specdec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop thread has stopped; no request can be served."""


class EngineShuttingDownError(RuntimeError):
    """The engine is draining or stopped and takes no new requests."""


class EngineLike(Protocol):
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    use_speculation: bool = True, grammar: Any = None) -> Any: ...
    async def compile_grammar(self, params: SamplingParams) -> Any: ...
    def prepare_grammars(self) -> None: ...
    def abort_request(self, request_id: str) -> RequestOutput | None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def get_metrics(self) -> dict[str, Any]: ...


class RequestRecord(Protocol):
    """One request's log lines (the server's: server/request_log.py, --enable-log-requests)."""

    def admitted(self, prompt: Prompt, params: SamplingParams, speculative: bool) -> None: ...
    def observe(self, output: RequestOutput, parent: ParentRequest) -> None: ...


# ---- per-request state shared by the two threads -----------------------------------------


class _Group:
    """One API request: its parent request (child ids, and the latest output of each child).

    Outputs are cumulative, so only the newest one per child is kept: a slow reader
    skips intermediate states instead of piling them up (memory stays O(1) per child).
    """

    def __init__(self, parent: ParentRequest, loop: asyncio.AbstractEventLoop, record: RequestRecord | None) -> None:
        self.parent = parent
        self.loop = loop
        self.record = record  # event loop side: the request's log lines (--enable-log-requests)
        self.updated = asyncio.Event()  # event loop side, as is the parent's per-child state
        self.unfinished: set[str] = set()  # engine thread side

    @property
    def request_id(self) -> str:
        return self.parent.request_id

    def deliver(self, output: RequestOutput) -> None:
        """Engine thread: hand one child's output to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self._store, output)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _store(self, output: RequestOutput) -> None:
        self.parent.update(output)
        if self.record is not None:
            self.record.observe(output, self.parent)
        self.updated.set()


@dataclass
class _Add:
    group: _Group
    prompt: Prompt
    use_speculation: bool
    grammar: Any  # the params' constraint, compiled already (None without one)
    future: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    pass


@dataclass
class _Stop:
    drain: bool


_Command = _Add | _Abort | _AbortAll | _Stop


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Event loop: settle an add-future unless its caller already gave up."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    try:
        future.get_loop().call_soon_threadsafe(_resolve, future, error)
    except RuntimeError:
        pass


def _error_output(request_id: str, base: RequestOutput | None, message: str) -> RequestOutput:
    if base is None:
        base = RequestOutput(request_id, None, [], [CompletionOutput(0, "", [])], True)
    base.outputs[0].finish_reason = "error"
    base.finished = True
    base.error = message
    return base


# ---- the caller's view of one request ----------------------------------------------------


class RequestStream:
    """Async iterator of merged, cumulative RequestOutputs; ends after the finished one."""

    def __init__(self, engine: AsyncEngine, group: _Group) -> None:
        self._engine = engine
        self._group = group
        self.finished = False
        self._aborted = False

    @property
    def request_id(self) -> str:
        return self._group.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._group.updated.wait()  # several steps may have landed: they coalesce
        self._group.updated.clear()
        merged = self._group.parent.merged()
        self.finished = merged.finished
        return merged

    def abort(self) -> None:
        """Abort in the engine (frees its KV blocks); a no-op once finished. Never blocks."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._engine.abort_nowait(self.request_id)


# ---- the engine front --------------------------------------------------------------------


class AsyncEngine:
    """`request_log`: makes each request's RequestRecord from its id, which logs a line when
    the request is admitted and when it finishes (None: no lines); the server sets it to
    server/request_log.py's RequestRecord for --enable-log-requests."""

    def __init__(self, engine: EngineLike, request_log: Callable[[str], RequestRecord] | None = None) -> None:
        self.engine = engine
        self.request_log = request_log
        self.can_speculate = int(getattr(engine, "num_speculative_tokens", 0) or 0) > 0
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._lock = threading.Lock()  # orders "submit" against "the loop has closed"
        self._closed = False
        self._accepting = True
        self._draining = False
        self._error: str | None = None
        self._groups: dict[str, _Group] = {}  # engine thread only
        self._children: dict[str, _Group] = {}  # child request id -> its group; engine thread only
        self.stats: dict[str, Any] = dict(engine.get_metrics())  # snapshot, replaced after each step
        engine.prepare_grammars()  # before the loop starts: it holds the GIL for a while
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    # -- status --

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_alive

    # -- event loop side --

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       use_speculation: bool = True) -> RequestStream:
        """Add the request; raises ValueError for a bad prompt or constraint before any
        streaming starts. A constraint is compiled first, off the engine thread, so a slow
        grammar never stalls the other requests' steps."""
        self._check_accepting()
        grammar = await self.engine.compile_grammar(params)
        loop = asyncio.get_running_loop()
        record = self.request_log(request_id) if self.request_log is not None else None
        group = _Group(ParentRequest(request_id, params), loop, record)
        future: asyncio.Future[None] = loop.create_future()
        self._submit(_Add(group, prompt, use_speculation, grammar, future))
        try:
            await future
        except asyncio.CancelledError:  # the caller went away: do not leave the request behind
            self.abort_nowait(request_id)
            raise
        if record is not None:
            record.admitted(prompt, params, use_speculation and self.can_speculate)
        return RequestStream(self, group)

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        try:
            self._submit(_Abort(request_id))
        except RuntimeError:
            pass  # the loop is gone: its requests are gone with it

    def abort_all(self) -> None:
        """Abort every request in flight (freeing their KV blocks); the loop goes on. Each
        stream ends with an "abort" output, which the server turns into an error event or a
        503: how a shutdown deadline ends what is still running."""
        try:
            self._submit(_AbortAll())
        except RuntimeError:
            pass  # the loop is gone: _close has failed its requests already

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (health reports 503); in-flight ones go on."""
        self._accepting = False

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the loop: drain=True finishes in-flight requests first, else aborts them."""
        self.begin_shutdown()
        try:
            self._submit(_Stop(drain))
        except RuntimeError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    def _check_accepting(self) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop has stopped: {self._error or 'shut down'}")
        if not self._accepting:
            raise EngineShuttingDownError("the server is shutting down and takes no new requests")

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"the engine loop has stopped: {self._error or 'shut down'}")
            self._commands.put(command)

    # -- engine thread side --

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            logger.exception("the engine loop died")
            # Clients read this: the exception's text may hold any request's input, the log has it.
            self._error = f"{type(exc).__name__} (the server log has the details)"
        finally:
            self._close()

    def _loop(self) -> None:
        stopping = False
        while True:
            busy = self.engine.has_unfinished_requests()
            stopping = self._handle_commands(block=not busy and not stopping) or stopping
            busy = self.engine.has_unfinished_requests()
            if stopping and not (self._draining and busy):
                return
            if busy:
                self._step()
            self.stats = dict(self.engine.get_metrics())

    def _handle_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one when idle); True once asked to stop."""
        stop = False
        try:
            command = self._commands.get(block=block)
            while True:
                stop = self._handle(command) or stop
                command = self._commands.get_nowait()
        except queue.Empty:
            return stop

    def _handle(self, command: _Command) -> bool:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._abort(command.request_id)
        elif isinstance(command, _AbortAll):
            self._abort_all()
        else:
            self._draining = command.drain
            if not command.drain:
                self._abort_all()
            return True
        return False

    def _add(self, command: _Add) -> None:
        group = command.group
        if not self._accepting:
            _settle(command.future, EngineShuttingDownError("the server is shutting down"))
            return
        if group.request_id in self._groups:
            _settle(command.future, ValueError(f"request id {group.request_id!r} is already in use"))
            return
        try:
            group.parent.add_to(self.engine, command.prompt, command.use_speculation, command.grammar)
        except Exception as exc:  # noqa: BLE001 - a bad prompt: add_to has undone the children it added
            _settle(command.future, exc)
            return
        self._groups[group.request_id] = group
        for child in group.parent.children:
            self._children[child.request_id] = group
            group.unfinished.add(child.request_id)
        _settle(command.future, None)

    def _abort(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        for child_id in list(group.unfinished):
            output = self.engine.abort_request(child_id)
            if output is None:
                output = _error_output(child_id, None, "the request was aborted")
                output.outputs[0].finish_reason = "abort"
            self._dispatch(output)

    def _abort_all(self) -> None:
        for request_id in list(self._groups):
            self._abort(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing the in-flight requests")
            self._fail_all(STEP_FAILED)
            return
        for output in outputs:
            self._dispatch(output)

    def _dispatch(self, output: RequestOutput) -> None:
        group = self._children.get(output.request_id)
        if group is None:
            return
        if output.finished:
            self._children.pop(output.request_id, None)
            group.unfinished.discard(output.request_id)
            if not group.unfinished:
                self._groups.pop(group.request_id, None)
        group.deliver(output)

    def _fail_all(self, message: str) -> None:
        for child_id in list(self._children):
            try:
                base = self.engine.abort_request(child_id)
            except Exception:
                logger.exception("could not abort %s", child_id)
                base = None
            self._dispatch(_error_output(child_id, base, message))

    def _close(self) -> None:
        """Loop exit: refuse new commands, then fail whatever is still waiting or running."""
        with self._lock:
            self._closed = True
            self._accepting = False
        message = f"the engine loop has stopped: {self._error or 'shut down'}"
        try:
            while True:
                command = self._commands.get_nowait()
                if isinstance(command, _Add):
                    _settle(command.future, EngineDeadError(message))
        except queue.Empty:
            pass
        for child_id in list(self._children):
            self._dispatch(_error_output(child_id, None, message))
