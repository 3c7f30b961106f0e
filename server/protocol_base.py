"""The strict base of every request body model: an unknown field is an error naming it, and
a value of the wrong JSON type (`true` or `1.5` for an integer) is refused, not coerced."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
