"""Typed model configuration read from a local Hugging Face checkpoint's config.json.

We read the raw JSON rather than going through transformers.AutoConfig: it needs no
network, works for any transformers version, and lets us accept both rope styles
(transformers < 5: top-level `rope_theta` + `rope_scaling`; transformers >= 5:
`rope_parameters` carrying rope_theta too) in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF architecture class name -> model_type. All share one implementation (LlamaForCausalLM).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(SUPPORTED_ARCHITECTURES.values())
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings, normalised from either config style."""

    theta: float = 10000.0
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    """What LlamaForCausalLM needs to know about a checkpoint."""

    model_type: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # bias on the attention output projection
    mlp_bias: bool  # bias on gate/up/down projections
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Not applied by our attention: contexts longer than this diverge from the reference
    # model, so the engine should cap its max length here (None: full attention).
    sliding_window: int | None
    checkpoint_dtype: str | None  # "bfloat16", ... as stored; informational

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read config.json (and generation_config.json's eos ids) from a local directory."""
        model_dir = Path(model_dir)
        raw = _read_json(model_dir / "config.json")
        generation = _read_json_if_exists(model_dir / "generation_config.json")
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a config.json dict; raises ValueError for unsupported models."""
        model_type, architecture = _check_supported(raw)
        _check_activation(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return cls(
            model_type=model_type,
            architecture=architecture,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_qkv_bias(model_type, raw),
            o_proj_bias=_o_bias(model_type, raw),
            mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=_eos_ids(raw, generation),
            bos_token_id=_optional_int(raw.get("bos_token_id")),
            sliding_window=_sliding_window(model_type, raw),
            checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {path.parent} (a local model directory)")
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def _read_json_if_exists(path: Path) -> dict[str, Any] | None:
    return _read_json(path) if path.is_file() else None


def _check_supported(raw: dict[str, Any]) -> tuple[str, str]:
    """Return (model_type, architecture) or raise naming what we got and what we support."""
    model_type = str(raw.get("model_type", ""))
    archs = [str(a) for a in raw.get("architectures") or []]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if model_type in SUPPORTED_MODEL_TYPES and (arch is not None or not archs):
        return model_type, arch or _arch_for(model_type)
    got = ", ".join(archs) or "<none>"
    raise ValueError(
        f"unsupported architecture {got} (model_type {model_type!r}); supported "
        f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _arch_for(model_type: str) -> str:
    return next(a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type)


def _check_activation(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Normalise old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) styles."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "full_attention" in params:  # per-layer-type layout of transformers 5
        params = dict(params["full_attention"])
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", defaults.theta))),
        rope_type=rope_type,
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings")
            or defaults.original_max_position_embeddings
        ),
    )


def _qkv_bias(model_type: str, raw: dict[str, Any]) -> bool:
    # Qwen2 always has q/k/v biases; Mistral never; Llama and Qwen3 follow the flag.
    if model_type == "qwen2":
        return True
    return model_type != "mistral" and bool(raw.get("attention_bias", False))


def _o_bias(model_type: str, raw: dict[str, Any]) -> bool:
    # attention_bias covers o_proj too for Llama and Qwen3, but not Qwen2.
    return model_type in ("llama", "qwen3") and bool(raw.get("attention_bias", False))


def _sliding_window(model_type: str, raw: dict[str, Any]) -> int | None:
    # Qwen configs carry a window that is only used when use_sliding_window is set.
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    return _optional_int(raw.get("sliding_window"))


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """Union of config.json's and generation_config.json's eos ids, config first."""
    ids: list[int] = []
    for source in (raw, generation or {}):
        value = source.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
