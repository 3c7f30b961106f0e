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
        from specdec.drafters.eagle3 import Eagle3Drafter, is_eagle3_dir
        from specdec.drafters.hybrid import HybridDrafter
        from specdec.drafters.medusa import build_recurrent_heads
        from specdec.drafters.recurrent_drafter import RecurrentDrafter
        from specdec.drafters.suffix import SuffixDrafter

        heads: RecurrentDrafter | Eagle3Drafter | None = None
        if spec.model:  # an EAGLE-3 head's directory, else recurrent Medusa heads
            heads = Eagle3Drafter.from_context(context) if is_eagle3_dir(spec.model) else build_recurrent_heads(context)
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
    if spec is not None and spec.method in ("eagle3", "hybrid") and spec.model and _is_eagle3(spec.model):
        from specdec.drafters.eagle3 import Eagle3Drafter

        tree_rows = spec.eagle_topk * spec.num_speculative_tokens
        return Eagle3Drafter.device_bytes(spec.model, block_size, dtype, max_num_seqs, tree_rows)
    return 0, 0


def _is_eagle3(name: str) -> bool:
    from specdec.drafters.eagle3 import is_eagle3_dir

    return is_eagle3_dir(name)
