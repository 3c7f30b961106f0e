"""A llama GGUF's tensors as HF names them: llama.cpp's tensor names mapped to HF's, and
the row order llama.cpp gives q and k projections for its RoPE. The GGUF loader
(gguf_loader.py) and the GGUF → HF converter (specdec/gguf_convert.py) both read them."""
from __future__ import annotations

import torch

# llama.cpp tensor names → HF names; {i} is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str:
    """The HF name of a llama GGUF tensor; ValueError for a tensor a llama has not."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not one of a llama model's")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def qk_row_order(rows: int, n_head: int) -> torch.Tensor:  # [rows] int64
    """Which GGUF row of a q or k projection each HF row is: llama.cpp stores each head's
    rows as (pair, half) interleaved for its RoPE, HF as (half, pair) for rotate-half."""
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)
