"""Builds the drafter that a speculative_config names."""
from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.drafters.base import Drafter

if TYPE_CHECKING:
    from specdec.engine import LLMEngine


def build_drafter(engine: LLMEngine) -> Drafter:
    spec = engine.config.speculative_config
    assert spec is not None
    if spec.method == "ngram":
        from specdec.drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from specdec.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_engine(engine)
    if spec.method == "medusa":
        from specdec.drafters.medusa import build_medusa

        return build_medusa(engine)
    raise ValueError(f"unknown speculative method {spec.method!r}")
