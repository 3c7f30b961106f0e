"""The request fields that constrain the output to a grammar, OpenAI's and vLLM's:

- `response_format`: `{"type": "text"}`, `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark, or GBNF
  with `::=`), and its newer `structured_outputs` object (`json`, `regex`, `choice`,
  `grammar`, `json_object`).

At most one may be given. Each becomes `SamplingParams.structured_outputs`; the engine
compiles it (an invalid schema, regex or grammar is a 400) and masks every position,
speculative or not. JSON output is compact (no free whitespace), which also lets the
engine draft a schema's fixed keys for free. `strict` is accepted and always holds: output
always follows the schema.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from specdec.sampling_params import StructuredOutputsParams
from specdec.server.protocol_base import StrictBody


class JsonSchemaFormat(StrictBody):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")  # {}: any JSON value
    strict: bool | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and allowed only with it')
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class StructuredOutputsField(StrictBody):
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    def constraint(self) -> StructuredOutputsParams:
        """ValueError unless exactly one is set (StructuredOutputsParams' own check)."""
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object)


class StructuredFields(StrictBody):
    """The constraint fields; generation request bodies inherit them."""

    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredFields:
        given = self.constraint_fields()
        if len(given) > 1:
            raise ValueError(f"give at most one of response_format, guided_json, guided_regex, guided_choice, "
                             f"guided_grammar and structured_outputs; got {', '.join(given)}")
        return self

    def constraint_fields(self) -> list[str]:
        """The names of the constraint fields this request sets (response_format "text" sets none)."""
        given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        return given

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint; ValueError for an empty structured_outputs object."""
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.constraint()
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if self.guided_json is not None:
            return StructuredOutputsParams(json=self.guided_json)
        if self.guided_regex is not None:
            return StructuredOutputsParams(regex=self.guided_regex)
        if self.guided_choice is not None:
            return StructuredOutputsParams(choice=self.guided_choice)
        if self.guided_grammar is not None:
            return StructuredOutputsParams(grammar=self.guided_grammar)
        return None
