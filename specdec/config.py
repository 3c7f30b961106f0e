"""Engine and speculation settings, validated once at start-up."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

METHODS = ("ngram", "draft_model", "medusa")
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB: ~46k tokens of KV for the default model in fp16
# KV cache storage dtypes (vLLM's --kv-cache-dtype). "auto" stores K/V in the model dtype,
# except fp16 for a float32 model (llama.cpp's default cache type): half the memory and
# bandwidth, and on the default model every greedy output and forced next token of
# evals/bench_kv_dtype.py is the same as with fp32 K/V.
# fp8 is float8_e4m3fn with one float32 scale per (slot, kv head): see kernels/kv_cache.py.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
}


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 5
    model: str | None = None  # draft model dir or known name (draft_model, medusa heads dir)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # Tree speculation: verify up to this many draft nodes per step (0: a chain of
    # num_speculative_tokens). The tree's depth is still at most num_speculative_tokens.
    num_tree_nodes: int = 0
    # Medusa static tree: paths of top-k ranks per head, e.g. [[0], [1], [0, 0]]
    # (None: Medusa-1 heads use the tree measured for them; recurrent heads draft
    # EAGLE-2 dynamic trees).
    tree_choices: list[list[int]] | None = None
    # Choose each step's draft length per request (down to 0) from measured forward costs
    # and running acceptance, for the most committed tokens per second (specdec/adaptive.py).
    # num_speculative_tokens (and num_tree_nodes) are then upper bounds.
    adaptive: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known keys: {sorted(known)}")
        if "method" not in raw:
            raise ValueError(f"speculative_config needs a 'method', one of {METHODS}")
        config = cls(**raw)
        config.validate()
        return config

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a verify step needs beyond the last committed token."""
        return self.num_tree_nodes or self.num_speculative_tokens

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not 0 <= self.num_tree_nodes <= 64:
            raise ValueError(f"num_tree_nodes must be in [0, 64], got {self.num_tree_nodes}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': a draft model directory or name")


@dataclass
class EngineConfig:
    model: str
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    kv_cache_dtype: str = "auto"  # a key of KV_CACHE_DTYPES
    enable_prefix_caching: bool = False
    speculative_config: SpeculativeConfig | None = None
    dtype: torch.dtype = torch.float32
    linear_backend: str = "auto"  # specdec.models.linear: auto | fp32 | cpp-fp16 | fp16 | int8 | bf16 | onednn-*
    attention_backend: str = "auto"  # specdec.kernels.attention: auto | cpp | torch
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}")
        from specdec.models.linear import default_linear_backend, get_linear_backend

        if self.linear_backend == "auto":
            self.linear_backend = default_linear_backend() if self.dtype == torch.float32 else "fp32"

        get_linear_backend(self.linear_backend)  # ValueError if unknown or unavailable
        from specdec.kernels.attention import check_backend

        check_backend(self.attention_backend)  # ValueError if unknown, KernelBuildError if "cpp" cannot build
        if self.linear_backend != "fp32" and self.dtype != torch.float32:
            raise ValueError(f"linear_backend {self.linear_backend!r} needs dtype float32 "
                             f"(activations stay fp32), got {self.dtype}")

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype: kv_cache_dtype, or for "auto" the model dtype,
        fp16 in place of float32."""
        model_dtype = torch.float16 if self.dtype == torch.float32 else self.dtype
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) or model_dtype
