"""Attention and KV-cache kernels: a torch reference for each, Triton on CUDA."""
from specdec.kernels.attention import paged_attention, store_kv
from specdec.kernels.kv_cache import PagedKV
from specdec.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "PagedKV", "paged_attention", "store_kv"]
