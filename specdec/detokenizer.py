"""Incremental detokenization that never emits half a UTF-8 character."""
from __future__ import annotations

from typing import Any

# Prompt tokens kept as context: enough for byte-level BPE merges and for
# leading-space handling to settle before the first output token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes output tokens one at a time; `text` only ever grows."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one token; return the newly stable text (may be empty)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._compact()
        self.text += delta
        return delta

    def decode_token(self, token_id: int) -> str:
        """One token's text on its own (a logprob's decoded_token, as vLLM's)."""
        return str(self.tokenizer.decode([token_id]))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _compact(self) -> None:
        # Keep the token window short so each step decodes O(1) tokens.
        drop = self.prefix_offset
        if drop > 64:
            self.token_ids = self.token_ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
