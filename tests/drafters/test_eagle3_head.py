"""The EAGLE-3 head: loading the published layout, refusing wrong ones, and its arithmetic
against a plain-torch transcription of the published layer."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdec.drafters.eagle3_head import (
    WEIGHTS,
    Eagle3Config,
    Eagle3Head,
    causal_attention,
    load_eagle3_head,
)
from specdec.models.config import ModelConfig
from tests.fixtures import make_checkpoint, make_eagle3_head


def target_parts(model_dir: Path) -> tuple[ModelConfig, torch.Tensor]:  # config, embedding [V, H]
    weights = load_file(str(model_dir / "model.safetensors"))
    return ModelConfig.from_dir(model_dir), weights["model.embed_tokens.weight"]


def load(head_dir: Path, model_dir: Path) -> Eagle3Head:
    config, embedding = target_parts(model_dir)
    return load_eagle3_head(head_dir, config, embedding)


# -- the published equations, written out independently ---------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # [T, H] -> [T, H]
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # [T, n, D], [T] -> [T, n, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]  # [T, D/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_layer(w: dict[str, torch.Tensor], cfg: dict, emb: torch.Tensor, feat: torch.Tensor,
                    pos: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One sequence: emb, feat [T, H], pos [T]; attends causally to past keys [P, nKV, D]
    plus these rows. Returns the pre-norm output [T, H] and all keys/values."""
    eps, nh, nkv, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    m = "midlayer."
    x = torch.cat((rms(emb, w[m + "input_layernorm.weight"], eps), rms(feat, w[m + "hidden_norm.weight"], eps)), -1)
    t = x.shape[0]
    q = rope((x @ w[m + "self_attn.q_proj.weight"].T).view(t, nh, d), pos, cfg["rope_theta"])
    k = rope((x @ w[m + "self_attn.k_proj.weight"].T).view(t, nkv, d), pos, cfg["rope_theta"])
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, nkv, d)
    if past is not None:
        k, v = torch.cat((past[0], k)), torch.cat((past[1], v))
    p = k.shape[0] - t
    out = torch.zeros(t, nh, d)
    for i in range(t):
        for head in range(nh):
            kv = head // (nh // nkv)
            s = (k[: p + i + 1, kv] @ q[i, head]) / math.sqrt(d)
            out[i, head] = torch.softmax(s, 0) @ v[: p + i + 1, kv]
    h = feat + out.reshape(t, nh * d) @ w[m + "self_attn.o_proj.weight"].T
    y = rms(h, w[m + "post_attention_layernorm.weight"], eps)
    mlp = (F.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)) @ w[
        m + "mlp.down_proj.weight"].T
    return h + mlp, (k, v)


def files(head_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(head_dir / WEIGHTS)), json.loads((head_dir / "config.json").read_text())


# -- loading ------------------------------------------------------------------------------------

def test_loads_published_layout(tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    head = load(tiny_eagle3_dir, tiny_model_dir)
    target, embedding = target_parts(tiny_model_dir)
    cfg = head.config
    assert cfg.draft_vocab_size == target.vocab_size // 2 and cfg.target_hidden_size == target.hidden_size
    assert cfg.aux_layers(target.num_layers) == (0, 1, 1)
    assert head.lm_head.weight.shape == (cfg.draft_vocab_size, cfg.hidden_size)
    assert head.fc.weight.shape == (cfg.hidden_size, 3 * target.hidden_size)
    # draft id i is target token 2i; t2d marks the even tokens
    assert head.to_target_ids(torch.tensor([0, 1, 5])).tolist() == [0, 2, 10]
    assert head.t2d.nonzero().flatten().tolist() == list(range(0, target.vocab_size, 2))
    ids = torch.tensor([3, 7])
    assert torch.equal(head.embed(ids), embedding[ids])  # no embed_tokens: the target's


def test_layer_matches_published_equations(tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    head = load(tiny_eagle3_dir, tiny_model_dir)
    w, cfg = files(tiny_eagle3_dir)
    _, embedding = target_parts(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(6, 3 * cfg["target_hidden_size"], generator=gen)
    ids = torch.randint(0, cfg["vocab_size"], (6,), generator=gen)
    pos = torch.arange(6) + 3
    feat = aux @ w["fc.weight"].T
    want, _ = reference_layer(w, cfg, embedding[ids], feat, pos)
    got = head.layer(head.embed(ids), head.project(aux), pos, causal_attention)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    logits = rms(want, w["norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T
    torch.testing.assert_close(head.logits(got), logits, atol=1e-4, rtol=1e-4)


def test_train_steps_are_drafting_steps(tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    """forward_train's step 1 at row t is what drafting depth 1 computes: the step-0 KV of
    rows <= t, then the head's own output fed back with the next token at position t+1."""
    head = load(tiny_eagle3_dir, tiny_model_dir)
    w, cfg = files(tiny_eagle3_dir)
    _, embedding = target_parts(tiny_model_dir)
    gen = torch.Generator().manual_seed(1)
    s = 7
    ids = torch.randint(0, cfg["vocab_size"], (2, s), generator=gen)
    aux = torch.randn(2, s, 3 * cfg["target_hidden_size"], generator=gen)
    mask = torch.ones(2, s, dtype=torch.long)
    mask[1, 5:] = 0  # right padding
    out0, out1 = head.forward_train(ids, aux, mask, depth=2)
    for b, length in ((0, s), (1, 5)):
        feat = aux[b, :length] @ w["fc.weight"].T
        step0, (k, v) = reference_layer(w, cfg, embedding[ids[b, :length]], feat, torch.arange(length))
        torch.testing.assert_close(out0[b, :length], step0, atol=1e-4, rtol=1e-4)
        for t in range(length - 1):
            want, _ = reference_layer(w, cfg, embedding[ids[b, t + 1 : t + 2]], step0[t : t + 1],
                                      torch.tensor([t + 1]), past=(k[: t + 1], v[: t + 1]))
            torch.testing.assert_close(out1[b, t], want[0], atol=1e-4, rtol=1e-4)


def test_layers0_naming_loads_the_same(tmp_path: Path, tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    other = make_eagle3_head(tmp_path / "h", tiny_model_dir, layer_prefix="layers.0.")
    assert any(n.startswith("layers.0.") for n in load_file(str(other / WEIGHTS)))
    a, b = load(tiny_eagle3_dir, tiny_model_dir), load(other, tiny_model_dir)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_own_embedding_and_full_vocab(tmp_path: Path, tiny_model_dir: Path) -> None:
    target, _ = target_parts(tiny_model_dir)
    head_dir = make_eagle3_head(tmp_path / "h", tiny_model_dir, own_embedding=True,
                                draft_vocab_size=target.vocab_size)
    tensors = load_file(str(head_dir / WEIGHTS))
    head = load_eagle3_head(head_dir, target, None)
    assert torch.equal(head.embed(torch.tensor([4])), tensors["embed_tokens.weight"][4:5])
    assert head.to_target_ids(torch.tensor([9])).item() == 9


def test_default_aux_layers_follow_vllm() -> None:
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "vocab_size": 384}
    assert Eagle3Config.from_dict(raw).aux_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_dict(raw).aux_layers(4)


# -- wrong layouts ------------------------------------------------------------------------------

def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, str(dst / WEIGHTS))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_tensor_is_named(tmp_path: Path, tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    w, _ = files(tiny_eagle3_dir)
    del w["midlayer.self_attn.k_proj.weight"]
    bad = rewrite(tiny_eagle3_dir, tmp_path / "h", tensors=w)
    message = r"missing tensor midlayer\.self_attn\.k_proj\.weight \(expected shape \[32, 128\]"
    with pytest.raises(ValueError, match=message):
        load(bad, tiny_model_dir)


def test_misshaped_tensor_is_named(tmp_path: Path, tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    w, _ = files(tiny_eagle3_dir)
    w["midlayer.self_attn.q_proj.weight"] = torch.zeros(64, 64)  # 1x hidden input: an EAGLE-1 layer
    bad = rewrite(tiny_eagle3_dir, tmp_path / "h", tensors=w)
    message = r"midlayer\.self_attn\.q_proj\.weight: expected shape \[64, 128\], found \[64, 64\]"
    with pytest.raises(ValueError, match=message):
        load(bad, tiny_model_dir)


def test_unexpected_tensor_is_named(tmp_path: Path, tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    w, _ = files(tiny_eagle3_dir)
    w["midlayer.self_attn.q_proj.bias"] = torch.zeros(64)
    bad = rewrite(tiny_eagle3_dir, tmp_path / "h", tensors=w)
    with pytest.raises(ValueError, match=r"unexpected tensor midlayer\.self_attn\.q_proj\.bias"):
        load(bad, tiny_model_dir)


def test_both_layer_names_refused(tmp_path: Path, tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    w, _ = files(tiny_eagle3_dir)
    w["layers.0.hidden_norm.weight"] = w["midlayer.hidden_norm.weight"].clone()
    bad = rewrite(tiny_eagle3_dir, tmp_path / "h", tensors=w)
    with pytest.raises(ValueError, match=r"midlayer\.hidden_norm\.weight: found twice"):
        load(bad, tiny_model_dir)


def test_hidden_size_must_match_target(tmp_path: Path, tiny_eagle3_dir: Path) -> None:
    wide = make_checkpoint(tmp_path / "wide", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    message = "target_hidden_size: the head expects a target of hidden size 64, the target has 96"
    with pytest.raises(ValueError, match=message):
        load(tiny_eagle3_dir, wide)


def test_bad_config_is_named(tmp_path: Path, tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    _, cfg = files(tiny_eagle3_dir)
    cases = [("architectures", ["LlamaForCausalLM"], "architectures: expected one of"),
             ("hidden_size", None, "hidden_size: expected a positive integer, found None"),
             ("num_hidden_layers", 2, "num_hidden_layers: expected 1"),
             ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}, r"outside 0\.\.1"),
             ("vocab_size", 500, "vocab_size: the head expects 500, the target has 384")]
    for i, (field, value, message) in enumerate(cases):
        bad = rewrite(tiny_eagle3_dir, tmp_path / str(i), config={**cfg, field: value})
        with pytest.raises(ValueError, match=message):
            load(bad, tiny_model_dir)


def test_bad_vocab_maps_refused(tmp_path: Path, tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    w, _ = files(tiny_eagle3_dir)
    without = {k: v for k, v in w.items() if k != "d2t"}
    with pytest.raises(ValueError, match=r"missing tensor d2t \(expected shape \[192\]\)"):
        load(rewrite(tiny_eagle3_dir, tmp_path / "a", tensors=without), tiny_model_dir)
    w["t2d"] = torch.ones_like(w["t2d"])
    with pytest.raises(ValueError, match="tensor t2d: does not mark exactly"):
        load(rewrite(tiny_eagle3_dir, tmp_path / "b", tensors=w), tiny_model_dir)


def test_target_embedding_parameter_is_not_the_heads(tiny_eagle3_dir: Path, tiny_model_dir: Path) -> None:
    """The target's embedding is usually an nn.Parameter: the head uses it without owning it."""
    config, embedding = target_parts(tiny_model_dir)
    head = load_eagle3_head(tiny_eagle3_dir, config, torch.nn.Parameter(embedding))
    assert "target_embedding" not in head.state_dict() and not any(p is embedding for p in head.parameters())
    assert torch.equal(head.embed(torch.tensor([5])), embedding[5:6])
