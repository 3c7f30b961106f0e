"""Engine and speculation settings, validated once at start-up."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import Field, dataclass, field, fields
from typing import Any

import torch

from specdec.model_registry import DEFAULT_MODEL

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
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) "
                f"<= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not 0 <= self.num_tree_nodes <= 64:
            raise ValueError(f"num_tree_nodes must be in [0, 64], got {self.num_tree_nodes}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': a draft model directory or name")


# Model dtypes by name (--dtype); "auto" is float32, the dtype the engine is tested in.
DTYPES: dict[str, torch.dtype] = {
    "auto": torch.float32, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
}
DEVICES = ("auto", "cpu", "cuda")
# The names of specdec.kernels.attention.BACKENDS (a test checks), spelled out because
# config must not import the kernels (they import it).
ATTENTION_BACKENDS = ("auto", "cpp", "torch", "triton")


def _option(default: Any, help: str, choices: Iterable[str] | None = None) -> Any:
    """An engine option: a field whose help text (and allowed values, when the set is fixed)
    the CLI flags and `LLM`'s keyword arguments are made from."""
    return field(default=default, metadata={"help": help, "choices": tuple(choices) if choices else None})


@dataclass
class EngineConfig:
    """Every engine option, defined once: `specdec serve/generate` flags and `LLM(...)`
    keyword arguments are derived from these fields (see `engine_options`)."""

    model: str = _option(DEFAULT_MODEL, "a known model name (see `specdec models pull`), a local Hugging Face "
                                        "model directory, or a .gguf file")
    speculative_config: SpeculativeConfig | None = _option(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'; '
              "none: plain decoding")
    max_model_len: int = _option(4096, "most tokens (prompt and output) of one request; capped by the model's "
                                       "max_position_embeddings")
    max_num_batched_tokens: int = _option(2048, "most tokens one engine step runs (prefill chunks, decode and "
                                                "draft tokens together)")
    max_num_seqs: int = _option(64, "most requests in the running batch")
    prefill_step_target_ms: float = _option(
        250.0, "while other requests decode, a prefill chunk is cut to what fits in about this many milliseconds "
               "of step time (measured as the engine runs), so their tokens keep flowing; 0: chunks fill "
               "max_num_batched_tokens")
    block_size: int = _option(16, "tokens per KV-cache block (a power of two up to 128)")
    kv_cache_memory: int = _option(DEFAULT_KV_CACHE_MEMORY, "bytes for the KV cache")
    kv_cache_dtype: str = _option("auto", "KV cache storage dtype (auto: the model dtype); fp16/bf16 halve KV "
                                          "memory, fp8 (e4m3 with per-token, per-head scales) about quarters it",
                                  choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = _option(False, "reuse the KV blocks of prompt prefixes computed before")
    dtype: torch.dtype = _option(torch.float32, "dtype of the model's weights and activations", choices=DTYPES)
    linear_backend: str = _option("auto", "packed CPU matmuls for the projections and LM head: auto | cpp-fp16 | "
                                          "fp16 | fp32 | int8 | int8-rowwise | bf16 | onednn-fp32 | onednn-bf16 "
                                          "(see evals/bench_kernels.py)")
    attention_backend: str = _option("auto", "attention: the C++ paged kernel (cpp, CPU), plain torch (torch) or "
                                             "Triton (triton, CUDA); auto: triton on CUDA, else cpp where it "
                                             "builds, else torch",
                                     choices=ATTENTION_BACKENDS)
    seed: int = _option(0, "seed of torch's global random generator, which requests without a seed sample from")
    device: str = _option("auto", "auto | cpu | cuda: where the model runs (auto: cuda when a GPU is visible, "
                                  "else cpu)", choices=DEVICES)
    chat_template: str | None = _option(None, "a Jinja chat template, or the path of a file holding one, used "
                                              "instead of the model's own (chat requests and LLM.chat)")

    def __post_init__(self) -> None:
        """Bring raw values (CLI strings, JSON, `LLM` keywords) to the types the engine
        uses: the one place engine options are converted."""
        self.dtype = _as_dtype(self.dtype)
        self.speculative_config = _as_speculative_config(self.speculative_config)
        if self.kv_cache_memory is None:  # "no preference", as callers may pass it through
            self.kv_cache_memory = DEFAULT_KV_CACHE_MEMORY
        _check_device(self.device)

    @property
    def torch_device(self) -> torch.device:
        """The device the engine runs on: `device`, with auto resolved."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def validate(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not self.prefill_step_target_ms >= 0:
            raise ValueError(f"prefill_step_target_ms must be >= 0, got {self.prefill_step_target_ms}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}")
        from specdec.kernels.linear import default_linear_backend, get_linear_backend

        if self.linear_backend == "auto":
            self.linear_backend = default_linear_backend() if self.dtype == torch.float32 else "fp32"

        get_linear_backend(self.linear_backend)  # ValueError if unknown or unavailable
        from specdec.kernels.attention import check_attention_backend

        check_attention_backend(self.attention_backend)  # ValueError if unknown, KernelBuildError if cpp cannot build
        if self.linear_backend != "fp32" and self.dtype != torch.float32:
            raise ValueError(f"linear_backend {self.linear_backend!r} needs dtype float32 "
                             f"(activations stay fp32), got {self.dtype}")

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype: kv_cache_dtype, or for "auto" the model dtype,
        fp16 in place of float32."""
        model_dtype = torch.float16 if self.dtype == torch.float32 else self.dtype
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) or model_dtype


def engine_options() -> list[Field[Any]]:
    """The engine options, in order: every field of EngineConfig."""
    return list(fields(EngineConfig))


def _as_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise ValueError(f"dtype {value!r} is not one of {list(DTYPES)}")
    return DTYPES[value]


def _as_speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from itself, a dict, or JSON text; None or "none" for no speculation."""
    if isinstance(value, str):
        if value.strip().lower() in ("", "none", "null"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON ({exc}): {value!r}") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    return SpeculativeConfig.from_dict(value)


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {list(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU here "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                         "use device 'cpu' or 'auto'")
