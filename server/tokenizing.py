"""The server's tokenizer work, off the event loop and off the engine thread: the server turns
prompts into token ids on one worker thread (HF tokenizers release the GIL while they encode,
and one thread means the tokenizer is never used by two at once) and hands the engine ids.

`min_tokens` is a lower bound of a text's token count without tokenizing it: each token
covers at most `max_token_bytes` bytes of the text, so a text of B UTF-8 bytes has at least
B / max_token_bytes tokens. That holds when the tokenizer drops no input and its normalizer
cannot shrink the text; for any other tokenizer there is no bound (0).
"""
from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

Result = TypeVar("Result")
# Normalizers and pre-tokenizers that keep (or grow) every byte of the text.
_KEEPING_NORMALIZERS = {"Prepend", "Replace", "Sequence", "ByteLevel"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Sequence"}
_MAX_CHAR_BYTES = 4  # an unknown character becomes one token of at most this many bytes


class ServerTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_token_bytes = longest_token_bytes(tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-tokenizer")

    def min_tokens(self, text: str) -> int:
        if self.max_token_bytes is None:
            return 0
        return -(-len(text.encode("utf-8")) // self.max_token_bytes)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(_encode, self.tokenizer, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return str(await self.run(self.tokenizer.decode, token_ids))

    async def run(self, fn: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def longest_token_bytes(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of text one token can stand for; None when no bound holds.

    A vocabulary piece is at least as long as the text it stands for: byte-level pieces use
    one character per byte, SentencePiece's `▁` (3 bytes) stands for a space, `<0x0A>` for a byte.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str()) if backend is not None else None
        vocab = tokenizer.get_vocab()
    except (AttributeError, TypeError, ValueError):
        return None
    if not isinstance(spec, dict) or not vocab or not _keeps_text(spec):
        return None
    return max(_MAX_CHAR_BYTES, max(len(piece.encode("utf-8")) for piece in vocab))


def _keeps_text(spec: dict[str, Any]) -> bool:
    model = spec.get("model") or {}
    unknowns_fused = bool(model.get("fuse_unk")) and not model.get("byte_fallback")
    return (model.get("type") == "BPE" and not unknowns_fused
            and _all_keep(spec.get("normalizer"), _KEEPING_NORMALIZERS, "normalizers")
            and _all_keep(spec.get("pre_tokenizer"), _KEEPING_PRE_TOKENIZERS, "pretokenizers"))


def _all_keep(step: dict[str, Any] | None, keeping: set[str], children: str) -> bool:
    if step is None:
        return True
    kind = step.get("type")
    if kind not in keeping:
        return False
    if kind == "Replace":
        pattern = step.get("pattern") or {}
        found = str(pattern.get("String", pattern.get("Regex", "")))
        return "String" in pattern and len(str(step.get("content", "")).encode()) >= len(found.encode())
    if kind == "Split" and step.get("behavior") == "Removed":
        return False
    return all(_all_keep(child, keeping, children) for child in step.get(children, []))
