"""The EAGLE-3 draft head in the published layout (Li et al. 2025; the format vLLM's and
SGLang's `llama_eagle3.py` load).

One Llama decoder layer drafts from the target's own features:

    g_t   = fc([a_low(t); a_mid(t); a_high(t)])          the 3 target layers' hidden states
    x     = [input_layernorm(e(x_{t+1})); hidden_norm(g_t)]          2H wide
    h     = g_t + o_proj(attention over the head's own KV of q/k/v_proj(x), RoPE at t)
    out_t = h + mlp(post_attention_layernorm(h))
    draft logits = lm_head(norm(out_t))   over the reduced draft vocabulary

`out_t` (before the final norm) is the next depth's feature: drafting unrolls the layer on
its own outputs, reading the token it just drafted, at position t+1, t+2, ... The attention
is pluggable (`Attend`), so the drafter can keep the head's KV in the engine's paged cache
while training runs plain SDPA over a mask.

Draft ids map to target ids through `d2t` (target = draft + d2t[draft]); `t2d` marks the
target tokens that have a draft id.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.models.config import ModelConfig, RopeConfig, parse_rope
from specdec.models.llama import rope_inv_freq

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "pytorch_model.bin"  # yuhuili/EAGLE3-* ship this
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
LAYER = "midlayer."
LAYER_ALIAS = "layers.0."  # some checkpoints name the one layer like a Llama layer

# q [T, nH, D], k [T, nKV, D], v [T, nKV, D] (RoPE applied) -> [T, nH, D]. The callee adds
# these rows' keys to whatever KV it keeps and scales by 1/sqrt(D).
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Eagle3Config:
    """A head's config.json in the published layout (`LlamaForCausalLMEagle3`)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: vLLM's default for the target (see aux_layers)
    tie_word_embeddings: bool
    norm_before_residual: bool  # residual taken after hidden_norm (some speculators heads)
    raw: dict[str, Any]  # the file as read, written back unchanged by `save_eagle3_head`

    @classmethod
    def from_dir(cls, path: str | Path) -> Eagle3Config:
        file = Path(path) / CONFIG
        if not file.is_file():
            raise ValueError(f"EAGLE-3 head {path}: no {CONFIG}")
        return cls.from_dict(json.loads(file.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Eagle3Config:
        """Read and check the fields; a missing or unsupported one raises ValueError naming it."""
        _check_architecture(raw)
        hidden = _int_field(raw, "hidden_size")
        heads = _int_field(raw, "num_attention_heads")
        vocab = _int_field(raw, "vocab_size")
        return cls(
            hidden_size=hidden,
            intermediate_size=_int_field(raw, "intermediate_size"),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layer_ids=_aux_layer_ids(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            raw=dict(raw),
        )

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input hidden states feed `fc` (HF `hidden_states[i]`,
        i.e. the output of layer i-1; 0 is the embedding): the configured ones, else
        vLLM's default low / middle / high (2, L//2, L-3)."""
        ids = self.aux_layer_ids
        if ids is None:
            if num_target_layers < 6:
                raise ValueError(
                    f"eagle_config.eagle_aux_hidden_state_layer_ids: the default (2, L//2, L-3) needs a"
                    f" target of 6 or more layers, found {num_target_layers}; give the ids in config.json")
            ids = (2, num_target_layers // 2, num_target_layers - 3)
        bad = [i for i in ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids: {list(ids)} has {bad}, outside"
                             f" 0..{num_target_layers - 1} for a target of {num_target_layers} layers")
        return tuple(ids)


def _check_architecture(raw: dict[str, Any]) -> None:
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise ValueError(f"architectures: expected one of {list(ARCHITECTURES)}, found {archs}")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"num_hidden_layers: expected 1 (one EAGLE-3 layer), found {raw['num_hidden_layers']}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: expected 'silu', found {raw['hidden_act']!r}")
    for flag in ("attention_bias", "mlp_bias", "bias"):
        if raw.get(flag):
            raise ValueError(f"{flag}: biases are not supported by this EAGLE-3 head, found true")


def _int_field(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, found {value!r}")
    return value


def _aux_layer_ids(raw: dict[str, Any]) -> tuple[int, ...] | None:
    eagle = raw.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    if ids is None:
        return None
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids: expected 3 layer ids, found {ids!r}")
    return tuple(ids)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        # Like HF Llama: normalise in fp32, cast back, then scale.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        width, d = 2 * config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(width, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(width, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(width, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, config.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Eagle3Head(nn.Module):
    """The head's weights under their published names (state_dict keys = file names)."""

    d2t: Tensor  # [Vd] int64: target id = draft id + d2t[draft id]
    t2d: Tensor  # [V] bool: target tokens the head can draft
    inv_freq: Tensor  # [D/2] float32 RoPE frequencies (not saved)

    def __init__(self, config: Eagle3Config, target_embedding: Tensor | None = None,
                 own_embedding: bool = False) -> None:  # target_embedding [V, H]
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(config.rope, config.head_dim), persistent=False)
        # Kept by reference (the target owns it), unregistered even when it is a Parameter.
        self.target_embedding = None if target_embedding is None else target_embedding.detach()

    # -- the pieces drafting and training share -------------------------------------------

    def embed(self, token_ids: Tensor) -> Tensor:  # [...] int64 target ids -> [..., H]
        table = self.embed_tokens.weight if self.embed_tokens is not None else self.target_embedding
        if table is None:
            raise ValueError("the head has no embed_tokens.weight and no target embedding was given")
        dtype = self.fc.weight.dtype
        return F.embedding(token_ids.to(table.device), table).to(device=self.fc.weight.device, dtype=dtype)

    def project(self, aux_hidden: Tensor) -> Tensor:  # [T, 3*H_t] -> [T, H]
        """The target's three layers' hidden states, concatenated low/mid/high, to a feature."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def layer(self, embeds: Tensor, features: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """One EAGLE-3 layer step: embeds [T, H] (of x_{t+1}), features [T, H] (`project`ed
        target features or the previous step's output), positions [T] int64 -> [T, H], the
        pre-norm output: the next step's feature and, through `logits`, the next guess."""
        mid, c = self.midlayer, self.config
        normed = mid.hidden_norm(features)
        residual = normed if c.norm_before_residual else features
        x = torch.cat((mid.input_layernorm(embeds), normed), dim=-1)  # [T, 2H]
        t = x.shape[0]
        cos, sin = self.rope(positions)
        q = apply_rope(mid.self_attn.q_proj(x).view(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(mid.self_attn.k_proj(x).view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = mid.self_attn.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        h = residual + mid.self_attn.o_proj(attend(q, k, v).reshape(t, c.num_heads * c.head_dim))
        return h + mid.mlp(mid.post_attention_layernorm(h))

    def logits(self, hidden: Tensor) -> Tensor:  # [T, H] pre-norm layer output -> [T, Vd]
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:  # [...] draft ids -> [...] target ids
        return draft_ids + self.d2t[draft_ids]

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [T] -> cos, sin [T, 1, D]
        angles = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        dtype = self.fc.weight.dtype
        return angles.cos().to(dtype), angles.sin().to(dtype)

    # -- training ----------------------------------------------------------------------------

    def forward_train(self, input_ids: Tensor, aux_hidden: Tensor, attention_mask: Tensor,
                      depth: int = 1) -> list[Tensor]:
        """EAGLE-3's training-time test over whole sequences.

        input_ids [B, S] int64: row t holds x_{t+1}, the token after the one whose target
        features are aux_hidden [B, S, 3*H_t]; attention_mask [B, S] (1 = real token).
        Step 0 is the layer over the target's features; step j >= 1 feeds step j-1's output
        back with x_{t+j+1} at position t+j, and row t attends to step 0's keys at rows <= t
        plus its own keys of steps 1..j: exactly what drafting depth j sees along a path.
        Returns the pre-norm outputs [B, S, H] of each step (step j guesses x_{t+j+2}).
        """
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).repeat(b)  # [B*S]
        features = self.project(aux_hidden.reshape(b * s, -1))
        keys: list[tuple[Tensor, Tensor]] = []  # per step: k, v [B, nKV, S, D]
        outputs = []
        for step in range(depth):
            ids = F.pad(input_ids[:, step:], (0, step))  # x_{t+step+1} at row t
            attend = _ttt_attend(keys, attention_mask.bool(), b, s)
            features = self.layer(self.embed(ids.reshape(-1)), features, positions + step, attend)
            outputs.append(features.view(b, s, -1))
        return outputs


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [T, n, D], cos/sin [T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """An `Attend` over these rows alone as one causal sequence: q [T, nH, D], k/v [T, nKV, D]
    -> [T, nH, D]. For tests and for a head without history."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def _ttt_attend(keys: list[tuple[Tensor, Tensor]], valid: Tensor, b: int, s: int) -> Attend:
    """Training-time-test attention for one step over [B*S] rows (valid [B, S] bool): adds
    the step's keys to `keys`, then attends causally to step 0's and diagonally to later
    steps' (see Eagle3Head.forward_train)."""

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        def split(x: Tensor) -> Tensor:  # [B*S, n, D] -> [B, n, S, D]
            return x.view(b, s, x.shape[1], x.shape[2]).transpose(1, 2)

        keys.append((split(k), split(v)))
        qs = split(q)
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        first = causal[None, None] & valid[:, None, None, :]  # [B, 1, S, S]
        scale = 1.0 / math.sqrt(q.shape[-1])
        groups = q.shape[1] // k.shape[1]
        k0 = keys[0][0].repeat_interleave(groups, dim=1)
        v0 = keys[0][1].repeat_interleave(groups, dim=1)
        scores = [(qs @ k0.transpose(-1, -2) * scale).masked_fill(~first, float("-inf"))]  # [B, nH, S, S]
        later = [(kj.repeat_interleave(groups, dim=1), vj.repeat_interleave(groups, dim=1)) for kj, vj in keys[1:]]
        scores += [(qs * kj).sum(-1, keepdim=True) * scale for kj, _ in later]  # [B, nH, S, 1] each
        weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        out = weights[..., :s] @ v0
        for j, (_, vj) in enumerate(later):
            out = out + weights[..., s + j : s + j + 1] * vj
        return out.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[2])

    return attend


# -- loading and saving ------------------------------------------------------------------------

def load_eagle3_head(path: str | Path, target_config: ModelConfig, target_embedding: Tensor | None,
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Load a head for this target (target_embedding [V, H_t]: the target's input embedding,
    used when the head has no `embed_tokens.weight`). A bad config, a missing, unexpected
    or mis-shaped tensor, or a head that does not fit the target raises ValueError naming
    the field or tensor with what was expected and found."""
    config = Eagle3Config.from_dir(path)
    check_fits_target(config, target_config)
    tensors = _normalise_names(read_tensors(Path(path)))
    own_embedding = "embed_tokens.weight" in tensors
    if not own_embedding:
        _check_target_embedding(config, target_embedding)
    expected = expected_shapes(config, own_embedding)
    _check_tensors(tensors, expected, config)
    head = Eagle3Head(config, target_embedding, own_embedding)
    state = {name: tensors[name] for name in expected if name in tensors}
    state.update(_vocab_maps(tensors, config))
    if "lm_head.weight" not in state:  # tied, full vocabulary: the embedding is the head
        table = tensors.get("embed_tokens.weight", target_embedding)
        assert table is not None
        state["lm_head.weight"] = table
    head.load_state_dict(state)
    return head.to(device=device, dtype=dtype).requires_grad_(False).eval()


def check_fits_target(config: Eagle3Config, target: ModelConfig) -> None:
    if config.target_hidden_size != target.hidden_size:
        raise ValueError(f"target_hidden_size: the head expects a target of hidden size {config.target_hidden_size},"
                         f" the target has {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"vocab_size: the head expects {config.vocab_size}, the target has {target.vocab_size}")
    if config.draft_vocab_size > config.vocab_size:
        raise ValueError(f"draft_vocab_size: expected at most vocab_size {config.vocab_size},"
                         f" found {config.draft_vocab_size}")
    config.aux_layers(target.num_layers)


def _check_target_embedding(config: Eagle3Config, table: Tensor | None) -> None:
    want = (config.vocab_size, config.hidden_size)
    if table is None:
        raise ValueError("embed_tokens.weight: the head has none and no target embedding was given")
    if tuple(table.shape) != want:
        raise ValueError(f"target embedding: expected shape {list(want)} (vocab_size, hidden_size),"
                         f" found {list(table.shape)}")


def expected_shapes(config: Eagle3Config, own_embedding: bool) -> dict[str, tuple[int, ...]]:
    """Every weight tensor's published name and shape (d2t / t2d aside)."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, 3 * config.target_hidden_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (config.num_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (config.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (config.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, config.num_heads * d),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
    }
    if own_embedding:
        shapes["embed_tokens.weight"] = (config.vocab_size, h)
    return shapes


def read_tensors(path: Path) -> dict[str, Tensor]:
    if (path / WEIGHTS).is_file():
        from safetensors.torch import load_file

        return load_file(str(path / WEIGHTS))
    if (path / LEGACY_WEIGHTS).is_file():
        loaded = torch.load(path / LEGACY_WEIGHTS, map_location="cpu", weights_only=True)
        return dict(loaded)
    raise ValueError(f"EAGLE-3 head {path}: no {WEIGHTS} or {LEGACY_WEIGHTS}")


def _normalise_names(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`layers.0.` -> `midlayer.`, a `model.` prefix dropped, derived RoPE buffers dropped."""
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        name = name.removeprefix("model.")
        if name.startswith(LAYER_ALIAS):
            name = LAYER + name[len(LAYER_ALIAS):]
        if name in out:
            raise ValueError(f"{name}: found twice (under both {LAYER!r} and {LAYER_ALIAS!r}?)")
        out[name] = tensor
    return out


def _check_tensors(tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]], config: Eagle3Config) -> None:
    optional = {"d2t", "t2d"}
    if config.tie_word_embeddings and config.draft_vocab_size == config.vocab_size:
        optional.add("lm_head.weight")
    missing = [n for n in expected if n not in tensors and n not in optional]
    if missing:
        raise ValueError(f"missing tensor {missing[0]} (expected shape {list(expected[missing[0]])})"
                         + (f" and {len(missing) - 1} more: {missing[1:]}" if len(missing) > 1 else ""))
    unexpected = sorted(set(tensors) - set(expected) - optional)
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]} (shape {list(tensors[unexpected[0]].shape)})"
                         f" in an EAGLE-3 head; all unexpected: {unexpected}")
    for name, shape in expected.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name}: expected shape {list(shape)}, found {list(tensors[name].shape)}")


def _vocab_maps(tensors: dict[str, Tensor], config: Eagle3Config) -> dict[str, Tensor]:
    """d2t and t2d, checked against each other; identity maps for a full draft vocabulary."""
    vd, v = config.draft_vocab_size, config.vocab_size
    if "d2t" not in tensors:
        if vd != v:
            raise ValueError(f"missing tensor d2t (expected shape [{vd}]): draft_vocab_size {vd} < vocab_size {v}")
        return {"d2t": torch.zeros(vd, dtype=torch.int64), "t2d": torch.ones(v, dtype=torch.bool)}
    d2t = tensors["d2t"]
    if tuple(d2t.shape) != (vd,):
        raise ValueError(f"tensor d2t: expected shape [{vd}], found {list(d2t.shape)}")
    target_ids = torch.arange(vd) + d2t.long()
    if target_ids.min() < 0 or target_ids.max() >= v or target_ids.unique().numel() != vd:
        raise ValueError(f"tensor d2t: draft id + d2t must be {vd} distinct target ids in 0..{v - 1}")
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[target_ids] = True
    if "t2d" in tensors:
        found = tensors["t2d"]
        if tuple(found.shape) != (v,):
            raise ValueError(f"tensor t2d: expected shape [{v}], found {list(found.shape)}")
        if not torch.equal(found.bool(), t2d):
            raise ValueError("tensor t2d: does not mark exactly the target ids d2t maps to")
    return {"d2t": d2t.long(), "t2d": t2d}


def save_eagle3_head(head: Eagle3Head, path: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write config.json and model.safetensors in the published layout (floats in `dtype`)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
             for name, t in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps(head.config.raw, indent=2) + "\n")
    return out


def config_dict(target: ModelConfig, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None,
                intermediate_size: int | None = None) -> dict[str, Any]:
    """A head config.json for `target` in the published layout (same attention shape as
    the target; `torch_dtype` is what save_eagle3_head writes by default)."""
    rope = target.rope
    scaling = None if rope.rope_type == "default" else {
        "rope_type": rope.rope_type, "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings}
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": target.hidden_size, "target_hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim, "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": rope.theta, "rope_scaling": scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False, "torch_dtype": "float16",
    }
    if aux_layer_ids is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    return raw
