"""Builds the drafter that a speculative_config names."""
from __future__ import annotations

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
        return HybridDrafter(SuffixDrafter(spec), heads, context.cost)
    if spec.method == "draft_model":
        from specdec.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_context(context)
    if spec.method == "medusa":
        from specdec.drafters.medusa import build_medusa

        return build_medusa(context)
    raise ValueError(f"unknown speculative method {spec.method!r}")
