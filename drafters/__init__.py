"""Drafters behind one interface: ngram, draft_model, medusa (and recurrent heads)."""
from specdec.drafters.base import Drafter, DrafterContext, DraftRequest

__all__ = ["DraftRequest", "Drafter", "DrafterContext"]
