"""What /openapi.json says a route's body is: a request model's JSON Schema with its ``$defs`` in place,
and the Tinker API's protobuf body."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

PROTOBUF_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/x-protobuf": {
                "schema": {"type": "string", "format": "binary", "description": "a ForwardBackwardRequest"}
            }
        },
    }
}


def schema_of(model: type[BaseModel]) -> dict:
    """The model's JSON Schema with its ``$defs`` put in place (the OpenAPI document has no ``$defs``
    beside a request body for a ``#/$defs/...`` reference to reach)."""
    raw = model.model_json_schema()
    defs = raw.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return inline({**defs[ref.rsplit("/", 1)[1]], **rest})
            return {k: inline(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(raw)


def body(model: type[BaseModel], *, required: bool = True) -> dict:
    """``openapi_extra`` of a route whose JSON body is ``model``."""
    return {
        "requestBody": {"required": required, "content": {"application/json": {"schema": schema_of(model)}}}
    }
