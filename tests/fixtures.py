"""Tiny random-weight checkpoints (model + byte-level BPE tokenizer) made on the spot."""
from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and the target model verifies them in one pass.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Summarise the following text in one sentence, please.",
    "héllo wörld — ünïcode ✓ 日本語 テキスト",
]


def make_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))


def make_checkpoint(path: Path, model_type: str = "llama", seed: int = 0, num_layers: int = 2,
                    vocab_size: int = 384, **overrides: object) -> Path:
    """A random model whose logits are peaked enough for stable greedy argmaxes."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, vocab_size)
    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}
    options: dict[str, object] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config = getattr(transformers, cls[model_type])(**{**options, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path))
    return path


def make_medusa_heads(path: Path, model_dir: Path, num_heads: int = 3, seed: int = 0) -> Path:
    """Random Medusa heads for a tiny checkpoint (format of drafters/weights/*-medusa)."""
    import json

    from safetensors.torch import save_file

    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_heads):
        tensors[f"heads.{i}.weight"] = torch.randn(hidden, hidden, generator=gen) * 0.1
        tensors[f"heads.{i}.bias"] = torch.zeros(hidden)
    save_file(tensors, str(path / "medusa_heads.safetensors"))
    (path / "medusa_config.json").write_text(json.dumps({"num_heads": num_heads, "hidden_size": hidden}))
    return path


def make_recurrent_heads(path: Path, model_dir: Path, num_heads: int = 3, seed: int = 0,
                         tree_choices: list[list[int]] | None = None) -> Path:
    """Random recurrent Medusa heads for a tiny checkpoint (drafters/recurrent_heads.py),
    drafting from every other token of the vocabulary."""
    import json

    from specdec.drafters import recurrent_heads

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    with torch.random.fork_rng():  # seeded, without touching the caller's RNG
        torch.manual_seed(seed)
        model = recurrent_heads.RecurrentHeads(hidden, 2 * hidden, num_heads)
        torch.nn.init.normal_(model.out.weight, std=0.2)  # zero-initialised for training
    vocab = torch.arange(0, config["vocab_size"], 2)
    recurrent_heads.save(model, path, {"tree_choices": tree_choices or []}, vocab)
    return path


def make_eagle3_head(path: Path, model_dir: Path, seed: int = 0, draft_vocab_size: int | None = None,
                     aux_layer_ids: tuple[int, ...] | None = (0, 1, 1), own_embedding: bool = False,
                     layer_prefix: str = "midlayer.") -> Path:
    """A random EAGLE-3 head for a tiny checkpoint in the published layout (config.json +
    model.safetensors, fp32): drafting from every other token of the vocabulary unless
    `draft_vocab_size` says otherwise; `layer_prefix="layers.0."` writes the other naming."""
    from safetensors.torch import load_file, save_file

    from specdec.drafters import eagle3_head
    from specdec.models.config import ModelConfig

    target = ModelConfig.from_dir(model_dir)
    vocab = torch.arange(0, target.vocab_size, 2) if draft_vocab_size is None else torch.arange(draft_vocab_size)
    raw = eagle3_head.config_dict(target, len(vocab), aux_layer_ids)
    with torch.random.fork_rng():  # seeded, without touching the caller's RNG
        torch.manual_seed(seed)
        head = eagle3_head.Eagle3Head(eagle3_head.Eagle3Config.from_dict(raw), own_embedding=own_embedding)
        for name, param in head.named_parameters():
            torch.nn.init.normal_(param, mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.2)
    head.d2t.copy_(vocab - torch.arange(len(vocab)))
    head.t2d.zero_()
    head.t2d[vocab] = True
    eagle3_head.save_eagle3_head(head, path, dtype=torch.float32)
    if layer_prefix != "midlayer.":
        file = path / eagle3_head.WEIGHTS
        tensors = {name.replace("midlayer.", layer_prefix): t for name, t in load_file(str(file)).items()}
        save_file(tensors, str(file))
    return path
