"""The base of every answer model, and how a route declares one without any per-request cost.

A route that returns a dict keeps answering it exactly as before: `described_by(Model)` is a `dict[str, Any]`
response_model, validated and serialized by FastAPI as the bare annotation was (the same bytes, and no model
built per request on the hot submit routes), whose JSON schema in /openapi.json is `Model`'s. The contract tests
(tests/api/test_response_models.py) hold the routes to their models: real answers must validate against them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, TypeAdapter
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema


class Answer(BaseModel):
    """A JSON answer whose fields are all ours: a field the model does not declare fails validation."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class OpenAnswer(BaseModel):
    """A JSON answer that may carry fields beyond those declared (an operator's settings, a client's metadata)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())


JsonFloat = float | Literal["NaN", "Infinity", "-Infinity"]
"""A float of a future's result: non-finite ones go out as these strings (api/finite_json.py)."""


class _SchemaOf:
    """Annotated metadata: `model`'s JSON schema in place of the annotated type's own."""

    def __init__(self, model: Any) -> None:
        self.model = model  # what the contract tests validate the route's answers against
        self.core = _as_reference(TypeAdapter(model).core_schema)

    def __get_pydantic_json_schema__(self, _: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return handler(self.core)


def _as_reference(core: CoreSchema) -> CoreSchema:
    """A model's schema as a `$ref` to its named component, as a plain `response_model=Model` shows it (inlined
    otherwise, under a name made from the route's)."""
    top = cast(dict[str, Any], core["schema"] if core["type"] == "definitions" else core)
    ref = top.get("ref")
    if ref is None:  # a union or a list: its members are references already
        return core
    return core_schema.definitions_schema(core_schema.definition_reference_schema(ref), [core])


def described_by(model: Any) -> Any:
    """The response_model of a route that returns a dict `model` describes (a model, or a union of them)."""
    return Annotated[dict[str, Any], _SchemaOf(model)]
