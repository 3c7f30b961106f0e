"""Logprobs in the two OpenAI shapes (legacy completions, chat), and the token strings they
name: a token that is only part of a UTF-8 character is named `bytes:\\xNN...`, as OpenAI does."""
from __future__ import annotations

import math
import re
from typing import Any

from specdec.outputs import Logprob, SampleLogprobs


class TokenStrings:
    """Each token's text, logprobs name and bytes, worked out once per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, str, bytes]] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone (U+FFFD for part of a character)."""
        return self._entry(token_id)[0]

    def name(self, token_id: int) -> str:
        """The token as logprobs name it: OpenAI's `bytes:\\xNN` form for part of a character."""
        return self._entry(token_id)[1]

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def raw_bytes(self, token_id: int) -> list[int]:
        return list(self._entry(token_id)[2])

    def _entry(self, token_id: int) -> tuple[str, str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = _describe_token(self.tokenizer, token_id)
        return entry


def completion_logprobs(tokens: TokenStrings, token_ids: list[int], logprobs: SampleLogprobs,
                        offset: int) -> dict[str, Any]:
    """Legacy completions shape; top_logprobs holds the top-k plus the sampled token."""
    offsets = []
    for token_id in token_ids:
        offsets.append(offset)
        offset += len(tokens.text(token_id))
    return {
        "tokens": [tokens.name(t) for t in token_ids],
        "token_logprobs": [_finite(_value(lp, t)) for t, lp in zip(token_ids, logprobs)],
        "top_logprobs": [{tokens.name(i): _finite(v.logprob) for i, v in lp.items()} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(tokens: TokenStrings, token_ids: list[int], logprobs: SampleLogprobs,
                  num_top: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        item = _chat_token(tokens, token_id, _value(entry, token_id))
        top = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num_top]
        item["top_logprobs"] = [_chat_token(tokens, i, v.logprob) for i, v in top]
        content.append(item)
    return {"content": content}


def _value(entry: dict[int, Logprob], token_id: int) -> float:
    found = entry.get(token_id)
    return -math.inf if found is None else found.logprob


def _chat_token(tokens: TokenStrings, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": tokens.name(token_id), "logprob": _finite(logprob), "bytes": tokens.raw_bytes(token_id)}


def _finite(value: float) -> float:
    """JSON has no -inf: a token the sampler masked out gets OpenAI's floor instead."""
    return value if math.isfinite(value) else -9999.0


def _describe_token(tokenizer: Any, token_id: int) -> tuple[str, str, bytes]:
    text = str(tokenizer.decode([token_id]))
    if "\ufffd" in text:
        raw = _piece_bytes(str(tokenizer.convert_ids_to_tokens(token_id)))
        if raw is not None and not _is_utf8(raw):
            return text, "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
    return text, text, text.encode("utf-8")


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE pieces back to bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_DECODER = _byte_level_decoder()
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _piece_bytes(piece: str) -> bytes | None:
    match = _SP_BYTE.match(piece)  # SentencePiece byte fallback, e.g. <0xE2>
    if match:
        return bytes([int(match.group(1), 16)])
    if piece and all(c in _BYTE_DECODER for c in piece):
        return bytes(_BYTE_DECODER[c] for c in piece)
    return None
