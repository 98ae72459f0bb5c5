"""JSON schemas for structured-output tests, and a checker for the subset of JSON Schema
they use (``jsonschema`` is not a dependency). Bounded everywhere (string lengths, array
sizes, number ranges), so a random model forced by the mask closes every value within a
modest ``max_tokens``."""

from __future__ import annotations

import re
from typing import Any

NAME = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
            "color": {"enum": ["red", "green", "blue"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["tags", "color", "score"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
    {"type": "boolean"},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": NAME, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def validate(value: Any, schema: dict[str, Any], where: str = "$") -> None:
    """The subset of JSON Schema the schemas above use; AssertionError names the place."""
    if "enum" in schema:
        assert value in schema["enum"], where
        return
    kind = schema["type"]
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind in ("integer", "number"):
        assert isinstance(value, int | float) and not isinstance(value, bool), where
        assert kind == "number" or isinstance(value, int), where
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), where
    else:
        assert isinstance(value, types[kind]), (where, value)
    if kind == "string":
        assert len(value) <= schema.get("maxLength", len(value)), where
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), where
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{where}[{i}]")
    if kind == "object":
        assert set(schema.get("required", ())) <= set(value), where
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), where
        for key, item in value.items():
            validate(item, schema["properties"][key], f"{where}.{key}")
