"""One request's fault, told apart from a fault of the whole step: what its own client is
told (its own constraint and problem, never another request's input, a grammar dump or a
backtrace) and what goes to the log (everything)."""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A problem of one request whose message is safe to show to that request's client."""


def fault_message(request_id: str, error: BaseException, doing: str) -> str:
    """Log one request's fault in full; return what its client may read."""
    if isinstance(error, RequestError):
        logger.warning("request %s failed while %s: %s", request_id, doing, error)
        return str(error)
    logger.error("request %s failed while %s", request_id, doing, exc_info=error)
    return f"internal error while {doing} this request ({type(error).__name__}); the server log has the details"


STEP_FAILED = "the engine step failed (an internal error, not this request's); the server log has the details"
