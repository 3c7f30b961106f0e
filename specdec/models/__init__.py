"""Model implementations (our own torch code), their checkpoint loader (HF directories and
GGUF files) and their tokenizers."""

from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM
from specdec.models.loader import load_model
from specdec.models.tokenizer import load_tokenizer

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model", "load_tokenizer"]
