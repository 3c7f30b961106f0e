"""Engine and speculation settings, validated once at start-up."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from specdec.model_registry import DEFAULT_MODEL, KNOWN_MODELS, model_cache_dir

METHODS = ("ngram", "suffix", "hybrid", "draft_model", "medusa", "eagle3")
# The default speculation (default_speculative_config): trees of up to 16 nodes, 16 deep
# (a long copied run is drafted whole; nodes not worth their verify row are cut).
DEFAULT_HEADS = "smollm2-135m-medusa-recurrent"  # shipped in drafters/weights, for DEFAULT_MODEL
# The EAGLE-3 head trained for DEFAULT_MODEL (drafters/weights): not the default yet, see
# eagle3_hybrid_config.
EAGLE3_HEADS = "smollm2-135m-eagle3"
DEFAULT_DRAFT_DEPTH = 16
DEFAULT_TREE_NODES = 16
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
    # draft_model: a draft model dir or known name; medusa: a heads dir or shipped name;
    # eagle3: an EAGLE-3 head dir (published layout) or shipped name; hybrid: recurrent
    # heads or an EAGLE-3 head that join suffix decoding (None: suffix decoding alone)
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # Tree speculation: verify up to this many draft nodes per step (0: a chain of
    # num_speculative_tokens). The tree's depth is still at most num_speculative_tokens.
    num_tree_nodes: int = 0
    # Medusa static tree: paths of top-k ranks per head, e.g. [[0], [1], [0, 0]]
    # (None: Medusa-1 heads use the tree measured for them; recurrent heads draft
    # EAGLE-2 dynamic trees).
    tree_choices: list[list[int]] | None = None
    # eagle3 dynamic trees (EAGLE-2): nodes expanded per depth and children tried per
    # node; the tree keeps the num_tree_nodes likeliest nodes (num_tree_nodes 0: a top-1
    # chain, eagle_topk unused).
    eagle_topk: int = 4
    # Choose each step's draft length per request (down to 0) from measured forward costs
    # and running acceptance, for the most committed tokens per second (specdec/spec/adaptive.py).
    # num_speculative_tokens (and num_tree_nodes) are then upper bounds.
    adaptive: bool = False
    # Suffix decoding (method "suffix", drafters/suffix.py): drafts from the request's own
    # prompt and output and from a per-engine cache of earlier requests' outputs.
    suffix_cache_max_requests: int = 1000  # requests the cache holds, oldest evicted first; 0: no cache
    suffix_cache_max_tokens: int = 1 << 20  # tokens the cache holds (its memory is proportional)
    suffix_cache_ttl_s: float = 600.0  # no request's text stays in the cache longer than this
    suffix_cross_request: bool = True  # False: a request drafts from its own prompt and output only
    suffix_max_depth: int = 24  # the longest context suffix matched (tokens)
    suffix_spec_factor: float = 1.0  # a draft is at most this many times as deep as the matched suffix
    suffix_min_prob: float = 0.1  # draft nodes whose empirical probability is lower are dropped

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
        if self.method == "hybrid" and self.tree_choices is not None:
            raise ValueError("speculative method 'hybrid' drafts dynamic trees: tree_choices applies to 'medusa' only")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': a draft model directory or name")
        self._validate_eagle3()
        self._validate_suffix()

    def _validate_eagle3(self) -> None:
        """The eagle3 keys: a head, dynamic trees only, eagle_topk in range and set only
        where an EAGLE-3 head can draft (methods 'eagle3' and 'hybrid')."""
        topk = self.eagle_topk
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= 16:
            raise ValueError(f"speculative_config eagle_topk must be an integer in [1, 16], got {topk!r}")
        if self.method not in ("eagle3", "hybrid") and topk != SpeculativeConfig.eagle_topk:
            raise ValueError(f"speculative_config eagle_topk applies to methods 'eagle3' and 'hybrid' only, "
                             f"not {self.method!r}")
        if self.method != "eagle3":
            return
        if not self.model:
            raise ValueError("speculative method 'eagle3' needs 'model': an EAGLE-3 head directory "
                             "(config.json and model.safetensors in the published layout) or a shipped head's name")
        if self.tree_choices is not None:
            raise ValueError("speculative method 'eagle3' drafts dynamic trees: tree_choices applies to 'medusa' only")
        if self.num_tree_nodes == 0 and topk not in (1, SpeculativeConfig.eagle_topk):
            raise ValueError(f"speculative_config eagle_topk {topk} needs num_tree_nodes > 0 (a tree): "
                             f"with num_tree_nodes 0 the head drafts a top-1 chain")

    def _validate_suffix(self) -> None:
        """The suffix_* keys: each in range, and set only for methods 'suffix' and 'hybrid'
        (elsewhere they would do nothing)."""
        defaults = SpeculativeConfig(method=self.method)
        names = [f.name for f in fields(self) if f.name.startswith("suffix_")]
        if self.method not in ("suffix", "hybrid"):
            stray = [name for name in names if getattr(self, name) != getattr(defaults, name)]
            if stray:
                raise ValueError(f"speculative_config keys {stray} apply to methods 'suffix' and 'hybrid' only, "
                                 f"not {self.method!r}")
            return
        checks: dict[str, tuple[Any, Any, str]] = {  # key: (type, range check, what is expected)
            "suffix_cache_max_requests": (int, lambda v: v >= 0, ">= 0 (0: no cross-request cache)"),
            "suffix_cache_max_tokens": (int, lambda v: 2 <= v <= 1 << 31, "in [2, 2**31]"),
            "suffix_cache_ttl_s": ((int, float), lambda v: v > 0, "> 0 seconds"),
            "suffix_cross_request": (bool, lambda v: True, "true or false"),
            "suffix_max_depth": (int, lambda v: 2 <= v <= 64, "in [2, 64]"),
            "suffix_spec_factor": ((int, float), lambda v: 0 < v <= 64, "in (0, 64]"),
            "suffix_min_prob": ((int, float), lambda v: 0 <= v <= 1, "in [0, 1]"),
        }
        for name, (kind, ok, expected) in checks.items():
            value = getattr(self, name)
            # bool is an int subclass: a JSON true is not a count.
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)) or not ok(value):
                raise ValueError(f"speculative_config {name} must be {expected}, got {value!r}")


# Model dtypes by name (--dtype). "auto" is float32 on the CPU, the dtype the engine is
# tested in; on CUDA it is the checkpoint's dtype (see auto_dtype).
DTYPES: dict[str, torch.dtype] = {
    "auto": torch.float32, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
}
DEVICES = ("auto", "cpu", "cuda")
# The engine's quantization values: "auto" is resolved at start-up to one of the loader's
# (specdec.models.loader.QUANTIZATIONS, which a test keeps equal to the rest).
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "q8_0", "q4_0", "q4_1")
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
        "auto", 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'; '
                "none: plain decoding; auto (on the CPU and on CUDA): adaptive hybrid drafting (suffix decoding, "
                "plus the shipped recurrent heads for the default model), which falls back to plain decoding "
                "wherever drafting does not pay")
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
    kv_cache_memory: int = _option(0, "bytes for the KV cache; 0: 1 GiB on the CPU, and on CUDA what "
                                      "gpu_memory_utilization leaves")
    gpu_memory_utilization: float = _option(
        0.9, "on CUDA with kv_cache_memory 0: the fraction of the GPU's memory the engine may use; the KV cache "
             "gets what the weights and a profiled forward of max_num_batched_tokens leave of it")
    kv_cache_dtype: str = _option("auto", "KV cache storage dtype (auto: the model dtype); fp16/bf16 halve KV "
                                          "memory, fp8 (e4m3 with per-token, per-head scales) about quarters it",
                                  choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of prompt prefixes computed before (as vLLM "
                                                "v1 does by default)")
    dtype: torch.dtype = _option("auto", "dtype of the model's weights and activations (auto: float32 on the CPU; "
                                         "on CUDA the checkpoint's bf16/fp16, bf16 for a float32 one)",
                                 choices=DTYPES)
    linear_backend: str = _option("auto", "matmuls of the projections and LM head: auto | cpp-fp16 | fp16 | fp32 | "
                                          "int8 | int8-rowwise | bf16 | onednn-fp32 | onednn-bf16 (packed CPU "
                                          "kernels, see evals/bench_kernels.py) | triton (CUDA: a batch-invariant "
                                          "Triton GEMM, so verify rows round as decode rows do and speculation "
                                          "stays lossless); auto: triton on CUDA; on CUDA fp32 is cuBLAS in the "
                                          "model dtype, which is not batch-invariant")
    quantization: str = _option("auto", "how the projections and LM head keep their weights: none (float, on "
                                        "linear_backend; a .gguf model dequantized at load), gguf (a .gguf model's "
                                        "own Q8_0/Q4_0/Q4_1 blocks on the C++ quantized kernels, no float copy), "
                                        "q8_0 | q4_0 | q4_1 (each projection quantized at load); auto: gguf for a "
                                        ".gguf file or a known model name (they ship as GGUF) on the CPU in float32 "
                                        "with linear_backend auto, else none",
                                choices=QUANTIZATION_CHOICES)
    quantized_activations: str = _option(
        "float32", "activations of the quantized kernels (quantization other than none): float32 (exact: the "
                   "float32 product with the dequantized weights), or int8 (opt-in and lossy: each activation row "
                   "quantized per 32 values, as llama.cpp does, and summed in integer SIMD, so verifying draft "
                   "tokens costs much less; output differs slightly from float32's, and speculation stays "
                   "lossless with respect to plain decoding in the same mode)", choices=("float32", "int8"))
    attention_backend: str = _option("auto", "attention: the C++ paged kernel (cpp, CPU), plain torch (torch) or "
                                             "Triton (triton, CUDA); auto: triton on CUDA, else cpp where it "
                                             "builds, else torch",
                                     choices=ATTENTION_BACKENDS)
    seed: int = _option(0, "seed of torch's global random generator, which requests without a seed sample from")
    device: str = _option("auto", "auto | cpu | cuda: where the model runs (auto: cuda when a GPU is visible, "
                                  "else cpu)", choices=DEVICES)
    enforce_eager: bool = _option(False, "on CUDA, run every step eagerly instead of replaying CUDA graphs "
                                         "captured for decode and verify batches (the CPU always runs eagerly)")
    async_scheduling: bool | None = _option(
        None, "overlap scheduling: launch each step's forward before reading the previous step's sampled tokens "
              "back, which stay on the device and feed the next step's inputs, so the GPU does not wait for the "
              "host between steps; the host commits them (streaming, stop checks) one step late, with identical "
              "outputs. Drafting and verifying steps run synchronously (drafts follow the tokens). None (auto): "
              "on for CUDA, off on the CPU (where host and device share the cores, so nothing overlaps)")
    chat_template: str | None = _option(None, "a Jinja chat template, or the path of a file holding one, used "
                                              "instead of the model's own (chat requests and LLM.chat)")
    max_grammar_compile_s: float = _option(
        10.0, "structured outputs: the most seconds one request's grammar may take to compile (on a worker "
              "thread, before the request is admitted); a slower one is refused (HTTP 400)")
    max_guided_choices: int = _option(10_000, "structured outputs: the most items of one request's choice list "
                                              "(guided_choice); a longer list is refused (HTTP 400)")
    max_grammar_bytes: int = _option(512 * 1024, "structured outputs: the most bytes of one request's JSON "
                                                 "schema, regex, grammar or choice list; a larger one is "
                                                 "refused (HTTP 400)")

    def __post_init__(self) -> None:
        """Bring raw values (CLI strings, JSON, `LLM` keywords) to the types the engine
        uses: the one place engine options are converted."""
        _check_device(self.device)
        self.dtype = _as_dtype(self.dtype, self.torch_device, self.model)
        self.quantization = _as_quantization(self.quantization, self.model, self.dtype, self.torch_device,
                                             self.linear_backend)
        self.speculative_config = _as_speculative_config(self.speculative_config, self.model, self.torch_device)
        if not self.kv_cache_memory and self.torch_device.type != "cuda":  # None, 0: "no preference"
            self.kv_cache_memory = DEFAULT_KV_CACHE_MEMORY
        self.kv_cache_memory = self.kv_cache_memory or 0

    @property
    def overlap_steps(self) -> bool:
        """Whether steps overlap (async_scheduling, with None resolved by the device)."""
        if self.async_scheduling is None:
            return self.torch_device.type == "cuda"
        return self.async_scheduling

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
        if self.kv_cache_memory < 0:
            raise ValueError(f"kv_cache_memory must be positive (or 0: the default size), got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.prefill_step_target_ms >= 0:
            raise ValueError(f"prefill_step_target_ms must be >= 0, got {self.prefill_step_target_ms}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if not (self.async_scheduling is None or isinstance(self.async_scheduling, bool)):
            raise ValueError(f"async_scheduling must be true, false or None (auto: on for CUDA), "
                             f"got {self.async_scheduling!r}")
        if not self.max_grammar_compile_s > 0:  # also refuses nan
            raise ValueError(f"max_grammar_compile_s must be a positive number of seconds, "
                             f"got {self.max_grammar_compile_s}")
        for name in ("max_guided_choices", "max_grammar_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {list(KV_CACHE_DTYPES)}")
        from specdec.kernels.linear import LINEAR_BACKENDS, get_linear_backend, resolve_linear_backend
        from specdec.kernels.linear_quant import ACTIVATIONS

        if self.quantized_activations not in ACTIVATIONS:
            raise ValueError(f"quantized_activations {self.quantized_activations!r} is not one of "
                             f"{list(ACTIVATIONS)}")
        if self.quantized_activations == "int8" and self.quantization == "none":
            raise ValueError("quantized_activations 'int8' applies to the quantized kernels: it needs quantization "
                             "gguf, q8_0, q4_0 or q4_1, not 'none'")
        if self.quantization != "none":  # "auto" stays, for a draft model's float projections
            self._check_quantization()
        elif self.linear_backend == "auto":
            self.linear_backend = resolve_linear_backend("auto", self.dtype, self.torch_device)
        if self.torch_device.type == "cuda" and self.linear_backend not in ("auto", "fp32", "triton"):
            raise ValueError(f"linear_backend {self.linear_backend!r} packs weights for the CPU; on CUDA the "
                             "projections run on 'triton' (batch-invariant) or 'fp32' (cuBLAS)")

        if self.linear_backend != "auto":
            get_linear_backend(self.linear_backend)  # ValueError if unknown or unavailable
        from specdec.kernels.attention import check_attention_backend

        check_attention_backend(self.attention_backend)  # ValueError if unknown, KernelBuildError if cpp cannot build
        graphs = self.torch_device.type == "cuda" and not self.enforce_eager
        if graphs and self.attention_backend not in ("auto", "triton"):
            raise ValueError(f"CUDA graphs are captured on the triton attention kernels: attention_backend "
                             f"{self.attention_backend!r} on CUDA needs enforce_eager=True")
        backend = LINEAR_BACKENDS.get(self.linear_backend)
        if (backend is None or backend.needs_fp32) and self.dtype != torch.float32:
            raise ValueError(f"linear_backend {self.linear_backend!r} needs dtype float32 "
                             f"(activations stay fp32), got {self.dtype}")

    def _check_quantization(self) -> None:
        from specdec.models.loader import QUANTIZATIONS

        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not one of {list(QUANTIZATIONS)}")
        if self.linear_backend != "auto":
            raise ValueError(f"quantization {self.quantization!r} gives the projections their own backend, so "
                             f"linear_backend {self.linear_backend!r} would go unused: leave it 'auto'")
        if self.dtype != torch.float32 or self.torch_device.type != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU in float32 activations, got "
                             f"dtype {self.dtype} on {self.torch_device}")

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype: kv_cache_dtype, or for "auto" the model dtype,
        fp16 in place of float32."""
        model_dtype = torch.float16 if self.dtype == torch.float32 else self.dtype
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype) or model_dtype


def engine_options() -> list[Field[Any]]:
    """The engine options, in order: every field of EngineConfig."""
    return list(fields(EngineConfig))


def _as_quantization(value: str, model: str, dtype: torch.dtype, device: torch.device, linear_backend: str) -> str:
    """What quantization "auto" means: a GGUF model (a .gguf file whose block types the
    quantized kernels read, or a known name: those ship as GGUF) runs on its own blocks
    where the kernels run it (the CPU, float32 activations, no float linear backend asked
    for); anything else keeps float weights."""
    if value != "auto":
        return value
    if not (device.type == "cpu" and dtype == torch.float32 and linear_backend == "auto"):
        return "none"
    from specdec.kernels.linear_gguf import GgufLinear
    from specdec.models.gguf_loader import is_gguf, keeps_blocks

    own_blocks = model in KNOWN_MODELS or (is_gguf(model) and keeps_blocks(model))
    return "gguf" if own_blocks and GgufLinear.is_available() else "none"


def _as_dtype(value: torch.dtype | str, device: torch.device, model: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise ValueError(f"dtype {value!r} is not one of {list(DTYPES)}")
    if value == "auto":
        return auto_dtype(device, checkpoint_dtype(model) if device.type == "cuda" else None)
    return DTYPES[value]


def auto_dtype(device: torch.device, checkpoint: str | None) -> torch.dtype:
    """What dtype "auto" means: float32 on the CPU; on CUDA a bf16/fp16 checkpoint's own
    dtype and, for a float32 (or unknown) one, bf16 where the GPU has it, else fp16, as
    vLLM does: float32 matmuls would leave the tensor cores idle."""
    if device.type != "cuda":
        return torch.float32
    if checkpoint in ("bfloat16", "float16"):
        return DTYPES[checkpoint]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def checkpoint_dtype(model: str) -> str | None:
    """The dtype config.json stores the weights in, for a local directory or a known model
    already pulled; None for a .gguf file or a model not on disk yet (nothing is pulled)."""
    for directory in (Path(model).expanduser(), model_cache_dir(model)):
        if (directory / "config.json").is_file():
            raw = json.loads((directory / "config.json").read_text())
            stored = raw.get("dtype") or raw.get("torch_dtype")
            return stored if isinstance(stored, str) else None
    return None


def _as_speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None, model: str,
                           device: torch.device) -> SpeculativeConfig | None:
    """A SpeculativeConfig from itself, a dict, or JSON text; None or "none" for no
    speculation; "auto" for the default (see `default_speculative_config`)."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return default_speculative_config(model, device)
        if value.strip().lower() in ("", "none", "null"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON ({exc}): {value!r}") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    return SpeculativeConfig.from_dict(value)


def default_speculative_config(model: str, device: torch.device) -> SpeculativeConfig | None:
    """Speculation when the user names none: adaptive hybrid drafting, on the CPU and on
    CUDA alike, which measures its costs (on CUDA with CUDA events, specdec/spec/step_timer.py)
    and falls to plain decoding where drafting does not pay.

    The shipped recurrent heads join suffix decoding for the default model only (heads are
    trained for one target); they load in the model's dtype on its device. Where the suffix
    index's C++ cannot be built (no compiler), plain decoding, with one warning."""
    from specdec.kernels import cpu_build

    if not cpu_build.builds("suffix_index", "plain decoding: the default speculation's suffix index is C++"):
        return None
    return _hybrid_config(DEFAULT_HEADS if model == DEFAULT_MODEL else None)


def eagle3_hybrid_config() -> SpeculativeConfig:
    """The default's adaptive hybrid drafting with the shipped EAGLE-3 head (for
    DEFAULT_MODEL) in place of the recurrent heads, to measure against the default; pass it
    (or its fields as JSON) as speculative_config."""
    return _hybrid_config(EAGLE3_HEADS)


def _hybrid_config(heads: str | None) -> SpeculativeConfig:
    """The default's adaptive hybrid drafting with these heads (None: suffix decoding alone)."""
    config = SpeculativeConfig(method="hybrid", num_speculative_tokens=DEFAULT_DRAFT_DEPTH,
                               num_tree_nodes=DEFAULT_TREE_NODES, adaptive=True, model=heads)
    config.validate()
    return config


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {list(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU here "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                         "use device 'cpu' or 'auto'")
