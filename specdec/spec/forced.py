"""Drafts a grammar forces: the tokens a request's constraint allows and no other come
next, so they are proposed as a chain the target verifies in one forward (jump-forward
decoding) instead of one forward each. Verification still decides: a forced draft is a
guess like any other."""
from __future__ import annotations

from specdec.scheduler import ScheduledRequest
from specdec.spec.tree import DraftTree


def forced_draft(item: ScheduledRequest) -> DraftTree:
    """The tokens the request's grammar forces next, within its draft budget; the root
    alone when nothing is forced (or it has no grammar)."""
    grammar = item.request.grammar
    forced = grammar.forced_tokens() if grammar is not None else []
    return DraftTree.chain([item.root_token, *forced]).prune(item.num_draft_tokens, item.max_depth)
