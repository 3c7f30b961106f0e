"""Per-request log lines (`specdec serve --enable-log-requests`): one when a request is
admitted, one when it finishes. They carry counts and timings, never the prompt's or the
output's text, nor the text of sampling fields (stop strings, bad words, schemas)."""
from __future__ import annotations

import logging
import time
from dataclasses import fields
from typing import Any

from specdec.outputs import RequestOutput
from specdec.parallel_sampling import ParentRequest, Prompt
from specdec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_DEFAULTS = SamplingParams()


class RequestRecord:
    """One request's timings, from its arrival at the engine front to its last output."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.logged_finish = False
        # The engine may finish a short request before its admission is logged (both reach
        # the event loop as callbacks): its end waits here, so the lines keep their order.
        self.is_admitted = False
        self.pending_final: RequestOutput | None = None

    def admitted(self, prompt: Prompt, params: SamplingParams, speculative: bool) -> None:
        size = f"{len(prompt)} prompt tokens" if isinstance(prompt, list) else f"a text prompt of {len(prompt)} chars"
        logger.info("request %s admitted: %s, params: %s, speculative: %s", self.request_id, size,
                    params_summary(params), "on" if speculative else "off")
        self.is_admitted = True
        if self.pending_final is not None:
            self.finished(self.pending_final)

    def observe(self, output: RequestOutput, parent: ParentRequest) -> None:
        """A child's newest output has reached the event loop; `parent` already holds it."""
        if self.first_token is None and any(c.token_ids for c in output.outputs):
            self.first_token = time.monotonic()
        if parent.finished and not self.logged_finish:
            self.logged_finish = True
            if self.is_admitted:
                self.finished(parent.merged())
            else:
                self.pending_final = parent.merged()

    def finished(self, final: RequestOutput) -> None:
        now = time.monotonic()
        reasons = ",".join(sorted({str(c.finish_reason) for c in final.outputs}))
        ttft = "n/a" if self.first_token is None else f"{self.first_token - self.arrival:.3f}s"
        logger.info("request %s finished: reason %s, %d prompt tokens, %d completion tokens, ttft %s, e2e %.3fs%s",
                    self.request_id, reasons, len(final.prompt_token_ids),
                    sum(len(c.token_ids) for c in final.outputs), ttft, now - self.arrival,
                    f", error: {final.error}" if final.error else "")


def params_summary(params: SamplingParams) -> str:
    """The fields set away from their defaults; a text-bearing field shows only its size."""
    parts = []
    for item in fields(SamplingParams):
        value = getattr(params, item.name)
        if item.init and value != getattr(_DEFAULTS, item.name):
            parts.append(f"{item.name}={_shown(value)}")
    return " ".join(parts) or "defaults"


def _shown(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, (str, list, tuple, dict)):
        return f"<{len(value)} {'chars' if isinstance(value, str) else 'items'}>"
    return "<set>"
