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
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark
from torch import Tensor

from specdec.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# No free whitespace inside JSON: a schema's fixed keys and punctuation are then forced
# tokens the engine drafts for free, and the output is the compact `{"a":1,"b":2}`. A
# schema's own "x-guidance" options come after these defaults.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarCompiler:
    """Builds grammars for one tokenizer (the llguidance view of it is built once)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def grammar(self, params: StructuredOutputsParams, eos_token_ids: set[int]) -> Grammar:
        """A fresh grammar state; ValueError naming the problem for an invalid constraint."""
        try:
            text = grammar_text(params)
        except ValueError as exc:  # JSON text that does not parse, or a schema that is not an object
            raise ValueError(f"structured outputs: invalid {_kind(params)}: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self._tokenizer)
        if is_error:
            raise ValueError(f"structured outputs: invalid {_kind(params)}: {messages[0] if messages else text}")
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs: invalid {_kind(params)}: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size, eos_token_ids, self._tokenizer)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (not yet checked)."""
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
            raise ValueError(f"structured outputs: the output left the grammar: {self._matcher.get_error()}")

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
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab_size].astype(np.bool_))
        if len(self._eos):
            mask[self._eos] = self._matcher.is_accepting()
        return mask
