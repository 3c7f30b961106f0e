"""Structured outputs on llguidance: a request's grammar, the token masks it puts on every
verified position, and the tokens it forces (proposed as drafts: jump-forward).

A request's `Grammar` follows its committed output (the engine calls `advance` after each
commit). A draft tree's row for node u predicts the token after the drafts on the path to
u, so its mask is the grammar's after those drafts too: `masks` consumes each path, reads
the mask and rolls back. A draft the grammar forbids gets probability 0 in its parent's
row and is rejected, greedy or sampled, so constrained speculation gives exactly the
tokens constrained plain decoding gives.

End of output: EOS ids are allowed exactly when the grammar accepts what came so far, and
are all a complete grammar allows, so the request ends with an EOS as it would without
a grammar (with ignore_eos it pads with EOS up to max_tokens, in both decoding modes).

Compilation is bounded and kept off the engine thread: `GrammarCompiler` builds grammars
on worker threads (llguidance drops the GIL while it builds one), refuses constraints over
the size limits before any work, waits at most `max_grammar_compile_s`, and caches compiled
grammars by their source. The server compiles before it admits a request and hands the
result along with it, so the engine thread only copies it. Errors a client sees name its own constraint and
the problem, never a grammar dump or a backtrace: llguidance runs with terse errors, and
anything unexpected it raises is logged in full and reported as a generic compile failure.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark
from torch import Tensor

from specdec.faults import RequestError
from specdec.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# No free whitespace inside JSON: a schema's fixed keys and punctuation are then forced
# tokens the engine drafts for free, and the output is the compact `{"a":1,"b":2}`. A
# schema's own "x-guidance" options come after these defaults.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_ROW_ITEMS = 2000  # llguidance's default bound on a grammar row's alternatives
# What may end a library message: dumps of the grammar, the parser's state, a backtrace.
_DUMPS = ("<state>", "<grammar>", "<backtrace>", "<non-verbose/>", "stack backtrace")
_CACHE_SIZE = 64  # compiled grammars kept, least recently used dropped first
_COMPILE_WORKERS = 2
logger = logging.getLogger(__name__)


class GrammarError(RequestError):
    """A request's constraint cannot be compiled or followed; the message is safe to show
    to the request's own client (it names the constraint and the problem, nothing more)."""


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's constraint may cost (EngineConfig max_grammar_* options)."""

    compile_s: float = 10.0  # seconds a compile may take, queueing for a worker included
    max_choices: int = 10_000  # items of a choice list
    max_bytes: int = 512 * 1024  # UTF-8 bytes of a schema, regex, grammar or choice list


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled once; each request following it gets its own copy."""

    key: str  # the constraint it was compiled from (see `_key`)
    matcher: llguidance.LLMatcher  # shared: never advanced itself


class GrammarCompiler:
    """Builds grammars for one tokenizer on worker threads, bounded and cached by source.
    Thread-safe: the server compiles on its event loop before it admits a request, and the
    engine thread gets the result with the request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], limits: GrammarLimits) -> None:
        self.vocab_size = vocab_size
        self.limits = limits
        self._hf_tokenizer = tokenizer
        self._eos_token_ids = set(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built with the first grammar
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=_COMPILE_WORKERS, thread_name_prefix="specdec-grammar")

    def grammar(self, params: StructuredOutputsParams, compiled: CompiledGrammar | None = None) -> Grammar:
        """A fresh grammar state for one request, from `compiled` when the caller compiled
        the constraint already (then no compiling can happen here); GrammarError for an
        invalid constraint or one over the limits."""
        if compiled is None:
            compiled = self.compile(params)
        elif compiled.key != _key(params):
            raise ValueError("the compiled grammar given is not the request's constraint")
        return Grammar(compiled.matcher.deep_copy(), self.vocab_size, self._eos_token_ids, self._tokenizer())

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, waiting at most compile_s."""
        future = self._submit(params)
        try:
            return future.result(timeout=self.limits.compile_s)
        except FutureTimeout:
            raise self._too_slow(params) from None

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """`compile` for an event loop: waits without blocking it."""
        future = asyncio.wrap_future(self._submit(params))
        try:  # shielded: a timed-out wait must not cancel a compile other requests may share
            return await asyncio.wait_for(asyncio.shield(future), self.limits.compile_s)
        except TimeoutError:
            raise self._too_slow(params) from None

    def _too_slow(self, params: StructuredOutputsParams) -> GrammarError:
        return GrammarError(f"structured outputs: the {_kind(params)} took longer than max_grammar_compile_s="
                            f"{self.limits.compile_s:g} s to compile")

    def _submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        key = _key(params)
        self._check_size(params)
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._pool.submit(self._build, params)
                self._compiled[key] = future
            self._compiled.move_to_end(key)
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return future

    def _check_size(self, params: StructuredOutputsParams) -> None:
        limits = self.limits
        if params.choice is not None and len(params.choice) > limits.max_choices:
            raise GrammarError(f"structured outputs: the choice list has {len(params.choice)} items, more than "
                               f"max_guided_choices={limits.max_choices}")
        size = len(_source(params).encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            raise GrammarError(f"structured outputs: the {_kind(params)} is {size} bytes, more than "
                               f"max_grammar_bytes={limits.max_bytes}")

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now: it holds the GIL for about half a
        second, which a server pays at start-up rather than stalling its streams later."""
        self._tokenizer()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def _build(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Worker thread: the compiled grammar, or GrammarError. llguidance validates while
        it builds, so one build is all the work."""
        kind = _kind(params)
        try:
            text = grammar_text(params)
            matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0, limits=_parser_limits(self.limits))
        except GrammarError:
            raise
        except BaseException as exc:  # noqa: BLE001 - a Rust panic is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            logger.warning("structured outputs: compiling a %s failed", kind, exc_info=True)
            raise GrammarError(f"structured outputs: invalid {kind}: it could not be compiled") from None
        if matcher.is_error():
            raise GrammarError(f"structured outputs: invalid {kind}: {_brief(matcher.get_error())}")
        return CompiledGrammar(_key(params), matcher)


def _parser_limits(limits: GrammarLimits) -> llguidance.LLParserLimits:
    """Terse errors (verbose ones carry the grammar and the parser's state); a choice list
    is one grammar row, which may be as long as max_choices."""
    return llguidance.LLParserLimits(verbose_errors=False, max_items_in_row=max(_ROW_ITEMS, limits.max_choices + 1))


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (not yet checked); GrammarError for a schema
    that is not valid JSON or not an object, or a grammar that is neither Lark nor GBNF."""
    kind = _kind(params)
    try:
        if params.json is not None:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if params.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        assert params.grammar is not None
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))  # GBNF (`::=`) or Lark
    except (ValueError, TypeError) as exc:  # JSON that does not parse, a schema that is not an object
        raise GrammarError(f"structured outputs: invalid {kind}: {_brief(str(exc))}") from None
    except Exception as exc:  # noqa: BLE001 - the GBNF converter's own errors
        logger.info("structured outputs: converting a %s failed: %r", kind, exc)
        raise GrammarError(f"structured outputs: invalid {kind}: {_brief(str(exc))}") from None


def _source(params: StructuredOutputsParams) -> str:
    """The constraint's text as the client gave it (what the size limit counts)."""
    if params.json is not None:
        return params.json if isinstance(params.json, str) else json.dumps(params.json, sort_keys=True)
    if params.regex is not None:
        return params.regex
    if params.choice is not None:
        return json.dumps(params.choice)
    return params.grammar or ""  # json_object has no text


def _key(params: StructuredOutputsParams) -> str:
    """One text per distinct constraint: the cache key."""
    return f"{_kind(params)}\0{_source(params)}"


def _brief(message: str, limit: int = 300) -> str:
    """A library message on one line, without dumps or backtraces, cut short: errors are
    read by the request's client. A panic is llguidance's own failure, not the request's
    fault to read about: the log has it."""
    if message.lstrip().startswith("panic"):
        logger.warning("llguidance panicked: %s", message)
        return "the grammar is too large or complex to compile"
    for marker in _DUMPS:
        message = message.split(marker, 1)[0]
    line = " ".join(message.split()) or "unknown error"
    return line if len(line) <= limit else line[:limit] + "…"


def _kind(params: StructuredOutputsParams) -> str:
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(params, name) is not None:
            return "JSON schema" if name == "json" else name
    return "json_object"


class Grammar:
    """One request's grammar, in step with its committed output tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: set[int],
                 tokenizer: llguidance.LLTokenizer) -> None:
        self._matcher = matcher
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = torch.tensor(sorted(t for t in eos_token_ids if t < vocab_size), dtype=torch.long)
        self._eos_ids = set(eos_token_ids)
        self.num_consumed = 0  # output tokens the matcher has taken
        self._ended = False  # an EOS was committed: the grammar takes no more text

    def advance(self, output_token_ids: Sequence[int]) -> None:
        """Take the output tokens committed since the last call."""
        new = self._grammar_text(output_token_ids[self.num_consumed:])
        self.num_consumed = len(output_token_ids)
        if new and not self._matcher.consume_tokens(new):
            raise GrammarError(f"structured outputs: the grammar failed at output token {self.num_consumed}: "
                               f"{_brief(self._matcher.get_error())}")

    def _check(self, doing: str) -> None:
        """GrammarError once the matcher has failed (a parser limit reached, say)."""
        if self._matcher.is_error():
            raise GrammarError(f"structured outputs: the grammar failed while {doing} after output token "
                               f"{self.num_consumed}: {_brief(self._matcher.get_error())}")

    def _grammar_text(self, tokens: Sequence[int]) -> list[int]:
        """The tokens up to the first EOS: an EOS ends the grammar's text, and what follows
        it (only with ignore_eos: more EOS) is not matched."""
        for i, token in enumerate(tokens):
            if token in self._eos_ids:
                self._ended = True
                return list(tokens[:i])
        return [] if self._ended else list(tokens)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward). Where the forced text could still
        merge with what follows into other tokens (a JSON string's opening quote), no token
        is forced: the text's own tokenization is then the guess, as a model mostly writes
        it so. Either way only a draft: verification decides."""
        forced = list(self._matcher.compute_ff_tokens())
        self._check("forcing tokens")
        if forced:
            return forced
        text = self._matcher.compute_ff_bytes()
        guess = list(self._tokenizer.tokenize_bytes(text)) if text else []
        valid = self._matcher.try_consume_tokens(guess) if guess else 0
        if valid:
            self._matcher.rollback(valid)
        return guess[:valid]

    def masks(self, paths: Sequence[Sequence[int]]) -> Tensor:  # [len(paths), V] bool, True = allowed
        """The allowed tokens after the committed output followed by each path of drafts.
        A path the grammar refuses part of is unreachable (its first refused draft is
        masked in an earlier row), so its row allows everything."""
        out = torch.ones(len(paths), self._vocab_size, dtype=torch.bool)
        ended = self._ended
        for row, drafts in enumerate(paths):
            path = self._grammar_text(drafts)
            consumed = self._matcher.try_consume_tokens(path) if path else 0
            if consumed == len(path):
                out[row] = self._mask()
            if consumed:
                self._matcher.rollback(consumed)
            self._ended = ended
        return out

    def _mask(self) -> Tensor:  # [V] bool
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        self._check("masking")
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab_size].astype(np.bool_))
        if len(self._eos):
            mask[self._eos] = self._matcher.is_accepting()
        return mask
