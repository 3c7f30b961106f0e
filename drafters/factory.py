"""Builds the drafter that a speculative_config names, and says what it will hold on the
device before it is built (the engine sizes its KV cache first). The engine core reaches
drafters only through this module and drafters/base.py."""
from __future__ import annotations

import torch

from specdec.config import SpeculativeConfig
from specdec.drafters.base import Drafter, DrafterContext


def build_drafter(context: DrafterContext) -> Drafter:
    spec = context.spec
    if spec.method == "ngram":
        from specdec.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        from specdec.drafters.suffix import SuffixDrafter

        return SuffixDrafter(spec)
    if spec.method == "hybrid":
        from specdec.drafters.hybrid import HybridDrafter
        from specdec.drafters.medusa import build_recurrent_heads
        from specdec.drafters.suffix import SuffixDrafter

        heads = build_recurrent_heads(context) if spec.model else None
        return HybridDrafter(SuffixDrafter(spec), heads)
    if spec.method == "draft_model":
        from specdec.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_context(context)
    if spec.method == "medusa":
        from specdec.drafters.medusa import build_medusa

        return build_medusa(context)
    if spec.method == "eagle3":
        from specdec.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter.from_context(context)
    raise ValueError(f"unknown speculative method {spec.method!r}")


def device_bytes(spec: SpeculativeConfig | None, block_size: int, dtype: torch.dtype,
                 max_num_seqs: int) -> tuple[int, int]:
    """(bytes per target KV block, fixed bytes) that the drafter `spec` names will take on
    the device once built, to count in before the target's KV cache is sized: a draft
    model's KV blocks and weights. (0, 0) for the others: n-gram and suffix drafters hold
    nothing there, Medusa and recurrent heads are small enough for the headroom; an
    EAGLE-3 head's KV and weights."""
    if spec is not None and spec.method == "draft_model" and spec.model:
        from specdec.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.device_bytes(spec.model, block_size, dtype, max_num_seqs)
    if spec is not None and spec.method == "eagle3" and spec.model:
        from specdec.drafters.eagle3 import Eagle3Drafter

        tree_rows = spec.eagle_topk * spec.num_speculative_tokens
        return Eagle3Drafter.device_bytes(spec.model, block_size, dtype, max_num_seqs, tree_rows)
    return 0, 0
