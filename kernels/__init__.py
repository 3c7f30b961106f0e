"""Compute backends: attention backends (torch, cpp, triton; kernels/attention.py), linear
backends (kernels/linear.py), the paged KV cache, and reference.py, the oracles they are
tested against."""
from specdec.kernels.attention import AttentionBackend, AttentionPlan, make_attention_backend
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionPlan", "PagedKV", "make_attention_backend"]
