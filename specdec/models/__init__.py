"""Model implementations (our own torch code) and their checkpoint loader."""

from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM
from specdec.models.loader import load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model"]
