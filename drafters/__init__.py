"""Drafters behind one protocol: ngram, draft_model, medusa."""
from specdec.drafters.base import Draft, Drafter, DraftRequest

__all__ = ["Draft", "DraftRequest", "Drafter"]
