"""A GGUF file loaded directly (issue 18): config, EOS, tokenizer and chat template from
its metadata, its weights either dequantized (equal to transformers' own GGUF loading) or
kept in their blocks (`quantization="gguf"`: no float copy, greedy output unchanged), and
unreadable files, other architectures and unsupported tensor types refused by name. Also
quantize-at-load (`quantization="q8_0"` ...), which puts any checkpoint in such blocks.

The GGUF is written here from the tiny random checkpoint, as llama.cpp's converter lays a
llama out (q/k rows permuted for its RoPE), with one fused projection mixing block types."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from specdec import SamplingParams
from specdec.config import EngineConfig
from specdec.kernels.linear_gguf import GgufLinear
from specdec.kernels.quantized_tensor import QuantizedTensor
from specdec.llm import LLM
from specdec.model_registry import DEFAULT_MODEL
from specdec.models import ModelConfig, load_model, load_tokenizer
from specdec.models.linear import PackedLinear
from specdec.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specdec.models.loader import QUANTIZATIONS
from tests.fixtures import CHATML
from tests.kernels.test_linear_quant import K_QUANTS, random_k_quants

T = GGMLQuantizationType
# HF name (after "model.layers.{i}.") -> llama.cpp's name and the block type written.
LAYER_TENSORS = {
    "input_layernorm": ("attn_norm", T.F32), "post_attention_layernorm": ("ffn_norm", T.F32),
    "self_attn.q_proj": ("attn_q", T.Q4_1), "self_attn.k_proj": ("attn_k", T.Q4_1),
    "self_attn.v_proj": ("attn_v", T.Q8_0), "self_attn.o_proj": ("attn_output", T.Q4_0),
    "mlp.gate_proj": ("ffn_gate", T.Q4_1), "mlp.up_proj": ("ffn_up", T.Q4_1), "mlp.down_proj": ("ffn_down", T.Q8_0),
}
GLOBAL_TENSORS = {"model.embed_tokens.weight": ("token_embd.weight", T.Q8_0),
                  "model.norm.weight": ("output_norm.weight", T.F32)}
KV_BYTES = 1 << 21


def _gguf_tensor(hf_name: str, tensor: torch.Tensor, config: dict[str, Any],
                 override: dict[str, T]) -> tuple[str, np.ndarray, T]:
    """llama.cpp's name, data and type for an HF tensor (q/k rows permuted as its converter
    does; K-quants, which gguf cannot quantize, random blocks)."""
    if hf_name in GLOBAL_TENSORS:
        name, qtype = GLOBAL_TENSORS[hf_name]
    else:
        _, _, layer, *module, kind = hf_name.split(".")
        short, qtype = LAYER_TENSORS[".".join(module)]
        name = f"blk.{layer}.{short}.{kind}"
    qtype = override.get(name, qtype)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(name.split(".")[-2])
    array = tensor.numpy()
    if heads:
        array = array.reshape(heads, 2, array.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(array.shape)
    if qtype == T.F32:
        return name, array, qtype
    if qtype.name.lower() in K_QUANTS:
        rows, cols = array.shape
        blocks = random_k_quants(qtype.name.lower(), rows, cols, torch.Generator().manual_seed(len(name)))
        return name, blocks.blocks.numpy(), qtype
    return name, quantize(array, qtype), qtype


def write_gguf(path: Path, model_dir: Path, arch: str = "llama", override: dict[str, T] | None = None,
               config_changes: dict[str, int] | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A quantized GGUF of an HF checkpoint (weights, BPE tokenizer, chat template); `override`
    gives some llama.cpp tensor names another type; `config_changes` and `tensors` make
    another model with the checkpoint's tokenizer."""
    config = {**json.loads((model_dir / "config.json").read_text()), **(config_changes or {})}
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())["model"]
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(ModelConfig.from_dir(model_dir).rope.theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(sorted(tokenizer["vocab"], key=tokenizer["vocab"].get))
    writer.add_token_types([1] * len(tokenizer["vocab"]))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(CHATML)
    for hf_name, tensor in (tensors or load_file(str(model_dir / "model.safetensors"))).items():
        name, data, qtype = _gguf_tensor(hf_name, tensor, config, override or {})
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def decoder_layer(model: LlamaForCausalLM, index: int) -> LlamaDecoderLayer:
    """model.layers[index], typed (an nn.ModuleList holds plain Modules)."""
    found = model.layers[index]
    assert isinstance(found, LlamaDecoderLayer)
    return found


def blocks_of(weight: torch.Tensor) -> QuantizedTensor:
    """A weight the test expects kept as GGUF blocks (typed as a Parameter)."""
    assert isinstance(weight, QuantizedTensor)
    return weight


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_model_dir)


@pytest.fixture(scope="module")
def transformers_model(tiny_gguf: Path) -> Any:
    """transformers' own reading of the GGUF (dequantized, q/k reordered) in its llama: the
    oracle (from_pretrained(gguf_file=...) would need accelerate, not installed here)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(tiny_gguf))["config"]
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(tiny_gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # the LM head is tied
    model.tie_weights()
    return model.eval()


def test_the_config_comes_from_the_metadata(tiny_gguf: Path, tiny_model_dir: Path) -> None:
    got, expected = load_model(tiny_gguf).config, ModelConfig.from_dir(tiny_model_dir)
    assert got.eos_token_ids == (2,) and got.bos_token_id == 1 and got.tie_word_embeddings
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "rope", "max_position_embeddings"):
        assert getattr(got, field) == getattr(expected, field), field
    assert got.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-7)  # stored as a float32


def test_dequantized_weights_equal_transformers_reading_of_the_file(tiny_gguf: Path, transformers_model: Any) -> None:
    model = load_model(tiny_gguf)
    hf = dict(transformers_model.named_parameters())
    second = decoder_layer(model, 1)
    fused = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(second.qkv_proj.weight, fused)  # q/k rows back in HF's order
    assert torch.equal(second.down_proj.weight, hf["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.embed_tokens, hf["model.embed_tokens.weight"])


def test_blocks_are_kept_without_a_float_copy(tiny_gguf: Path) -> None:
    model = load_model(tiny_gguf, quantization="gguf")
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(isinstance(m.weight, QuantizedTensor) and isinstance(m.backend, GgufLinear) for m in linears)
    assert blocks_of(decoder_layer(model, 0).qkv_proj.weight).qtypes == ("q4_1", "q8_0")  # q and k, then v
    assert blocks_of(model.embed_tokens).qtypes == ("q8_0",) and model.lm_head.weight is model.embed_tokens
    floats = sum(p.numel() for p in model.parameters() if not isinstance(p, QuantizedTensor))
    assert floats == (2 * model.config.num_layers + 1) * model.config.hidden_size  # the norms alone


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    from tests.models.test_linear_backends import _logits as prefill_then_decode

    return prefill_then_decode(model, ids)


def test_block_logits_equal_the_dequantized_model_up_to_summation_order(tiny_gguf: Path) -> None:
    ids = torch.randint(3, 384, (14,), generator=torch.Generator().manual_seed(2))
    dense = _logits(load_model(tiny_gguf), ids)
    blocks = _logits(load_model(tiny_gguf, quantization="gguf"), ids)
    torch.testing.assert_close(blocks, dense, atol=1e-4, rtol=1e-4)


PROMPTS = [[5, 6, 7] * 10, [9, 10, 11, 12] * 6 + [9, 10], [20, 21] * 12]


def test_greedy_output_equals_transformers_and_speculation_is_lossless(tiny_gguf: Path,
                                                                       transformers_model: Any) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(tiny_gguf), quantization="gguf", max_model_len=128, kv_cache_memory=KV_BYTES,
                speculative_config=None)
    spec = LLM(str(tiny_gguf), quantization="gguf", max_model_len=128, kv_cache_memory=KV_BYTES,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    outputs = [list(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, greedy)]
    assert [list(o.outputs[0].token_ids) for o in spec.generate(PROMPTS, greedy)] == outputs
    assert spec.get_metrics()["num_accepted_tokens"] > 0
    for prompt, out in zip(PROMPTS, outputs):
        ref = transformers_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                          min_new_tokens=16)[0, len(prompt):]
        assert out == ref.tolist()


def test_tokenizer_chat_template_and_eos_come_from_the_file(tiny_gguf: Path, tiny_model_dir: Path) -> None:
    tokenizer, reference = load_tokenizer(tiny_gguf), load_tokenizer(tiny_model_dir)
    text = "The quick brown fox, héllo wörld"
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.chat_template == CHATML and tokenizer.eos_token_id == 2
    assert load_tokenizer(tiny_gguf).encode(text) == reference.encode(text)  # from the cache now
    llm = LLM(str(tiny_gguf), quantization="gguf", max_model_len=64, kv_cache_memory=KV_BYTES)
    assert 2 in llm.engine.eos_token_ids and llm.model_dir == tiny_gguf


@pytest.mark.parametrize("cut", [0.5, 0.9, 0.01])
def test_a_truncated_file_is_a_clear_error(tiny_gguf: Path, tmp_path: Path, cut: float) -> None:
    data = tiny_gguf.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(broken, quantization="gguf")


def test_a_file_that_is_no_gguf_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):  # the tokenizer, read first, says so too
        LLM(str(tmp_path / "model.gguf"), max_model_len=64)


def test_another_architecture_is_refused_by_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", tiny_model_dir, arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(path)


def test_a_block_type_the_kernels_do_not_run_is_refused_by_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q5.gguf", tiny_model_dir, override={"blk.1.ffn_up.weight": T.Q5_0})
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight has type Q5_0, which quantization 'gguf' does not run"):
        load_model(path, quantization="gguf")
    assert decoder_layer(load_model(path), 1).gate_up_proj.weight.dtype == torch.float32  # dequantized, it loads


def test_quantization_options_are_checked(tiny_gguf: Path, tiny_model_dir: Path) -> None:
    assert EngineConfig.__dataclass_fields__["quantization"].metadata["choices"] == ("auto", *QUANTIZATIONS)
    with pytest.raises(ValueError, match="linear_backend 'fp16' would go unused"):
        LLM(str(tiny_gguf), quantization="gguf", linear_backend="fp16")
    with pytest.raises(ValueError, match="quantization 'int4' is not one of"):
        LLM(str(tiny_gguf), quantization="int4")
    with pytest.raises(ValueError, match="runs on the CPU in float32"):
        LLM(str(tiny_gguf), quantization="gguf", dtype="bfloat16")
    with pytest.raises(ValueError, match="quantization 'gguf' runs a .gguf model's own blocks"):
        LLM(str(tiny_model_dir), quantization="gguf")


def test_k_quants_run_on_their_exactly_repacked_blocks(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A model of 256-wide rows (K-quants come in 256-weight super-blocks) mixing Q4_K,
    Q5_K and Q6_K, one fused projection holding all three."""
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
              "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
              "mlp.down_proj": (256, 512), "input_layernorm": (256,), "post_attention_layernorm": (256,)}
    gen = torch.Generator().manual_seed(9)
    tensors = {f"model.layers.0.{module}.weight": torch.randn(shape, generator=gen) * 0.1 + (len(shape) == 1)
               for module, shape in shapes.items()}
    tensors |= {"model.embed_tokens.weight": torch.randn(384, 256, generator=gen) * 0.2, "model.norm.weight":
                torch.ones(256)}
    types = {"blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q5_K, "blk.0.attn_v.weight": T.Q6_K,
             "blk.0.attn_output.weight": T.Q5_K, "blk.0.ffn_gate.weight": T.Q4_K, "blk.0.ffn_up.weight": T.Q6_K,
             "blk.0.ffn_down.weight": T.Q6_K}
    path = write_gguf(tmp_path / "k.gguf", tiny_model_dir, override=types, tensors=tensors,
                      config_changes={"hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
                                      "num_hidden_layers": 1})
    blocks = load_model(path, quantization="gguf")
    assert blocks_of(decoder_layer(blocks, 0).qkv_proj.weight).qtypes == ("q4_k", "q5_k", "q6_k")
    dense = load_model(path)
    assert torch.equal(blocks_of(decoder_layer(blocks, 0).qkv_proj.weight).dequantize(),
                       decoder_layer(dense, 0).qkv_proj.weight)
    ids = torch.randint(3, 384, (14,), generator=gen)
    torch.testing.assert_close(_logits(blocks, ids), _logits(dense, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
def test_quantize_at_load_keeps_blocks_only_and_speculation_lossless(tiny_model_dir: Path, qtype: str) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(tiny_model_dir), quantization=qtype, max_model_len=128, kv_cache_memory=KV_BYTES,
                speculative_config=None)
    spec = LLM(str(tiny_model_dir), quantization=qtype, max_model_len=128, kv_cache_memory=KV_BYTES,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    model = plain.engine.model
    assert all(blocks_of(m.weight).qtypes == (qtype,) for m in model.modules() if isinstance(m, PackedLinear))
    assert model.embed_tokens is model.lm_head.weight  # the tied table, quantized once
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy)] == \
        [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy)]


def test_quantize_at_load_is_close_to_the_float_model(tiny_model_dir: Path, tiny_gguf: Path) -> None:
    ids = torch.randint(3, 384, (14,), generator=torch.Generator().manual_seed(5))
    dense = _logits(load_model(tiny_model_dir), ids)
    q8 = _logits(load_model(tiny_model_dir, quantization="q8_0"), ids)
    assert float((q8 - dense).norm() / dense.norm()) < 5e-2
    requantized = load_model(tiny_gguf, quantization="q4_0")  # a GGUF's floats put in other blocks
    assert blocks_of(decoder_layer(requantized, 0).qkv_proj.weight).qtypes == ("q4_0",)


def test_the_exact_kernel_reads_q4_1_with_float_headers_and_int8_activations_without(tiny_gguf: Path) -> None:
    """float32 activations: Q4_1 packed with float32 headers (faster for that kernel);
    int8 activations: as the file stores it (fewer bytes, which that kernel prefers)."""
    for activations, q4_1_format in (("float32", 3), ("int8", 2)):
        model = load_model(tiny_gguf, quantization="gguf", quantized_activations=activations)
        parts = blocks_of(decoder_layer(model, 0).qkv_proj.weight).parts
        assert [(p.qtype, p.format_id) for p in parts] == [("q4_1", q4_1_format), ("q8_0", 0)]


def test_the_quantization_flag(tiny_gguf: Path) -> None:
    import argparse

    from specdec.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([str(tiny_gguf), "--quantization", "gguf"]).quantization == "gguf"
    assert parser.parse_args([]).quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])


def test_auto_quantization_runs_a_gguf_on_its_own_blocks_where_it_can(tiny_gguf: Path, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    assert EngineConfig(model=str(tiny_gguf)).quantization == "gguf"
    assert EngineConfig().quantization == "gguf"  # the default model ships as GGUF
    assert EngineConfig(model=str(tiny_model_dir)).quantization == "none"  # an HF directory
    # A float linear backend, another dtype or a file with a block type the kernels do not
    # read: dequantized at load, as quantization "none".
    assert EngineConfig(model=str(tiny_gguf), linear_backend="cpp-fp16").quantization == "none"
    assert EngineConfig(model=str(tiny_gguf), dtype="bfloat16").quantization == "none"  # type: ignore[arg-type]
    q5 = write_gguf(tmp_path / "q5.gguf", tiny_model_dir, override={"blk.1.ffn_up.weight": T.Q5_0})
    assert EngineConfig(model=str(q5)).quantization == "none"
    assert EngineConfig(model=str(tmp_path / "missing.gguf")).quantization == "none"
    llm = LLM(str(tiny_gguf), speculative_config=None)
    assert blocks_of(decoder_layer(llm.engine.model, 0).qkv_proj.weight).qtypes  # blocks, not a float copy


@pytest.mark.slow
def test_the_default_model_on_its_own_q4_1_blocks_matches_transformers() -> None:
    """Greedy output on the GGUF's own Q4_1/Q8_0 blocks equals transformers' fp32 greedy
    on the dequantized checkpoint directory, for 10 short chats of 24 tokens."""
    from transformers import AutoModelForCausalLM

    from specdec.model_registry import resolve_model

    llm = LLM(DEFAULT_MODEL, quantization="gguf", max_model_len=512, kv_cache_memory=1 << 26, kv_cache_dtype="fp32",
              speculative_config=None)
    assert isinstance(decoder_layer(llm.engine.model, 0).qkv_proj.weight, QuantizedTensor)
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(DEFAULT_MODEL)), dtype=torch.float32).eval()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
                 "Name three primary colors.", "How do plants make food?", "Say hello in Spanish.",
                 "What is the boiling point of water?", "Give me a synonym for happy.",
                 "Why is the sky blue?", "Translate 'thank you' to German."]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for ids, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref
