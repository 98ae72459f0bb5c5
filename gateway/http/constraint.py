"""The constraint of an OpenAI request body: ``response_format`` (``json_object``,
``json_schema``) and vLLM's structured-output extras, mapped onto one
``engine.constraint.Constraint``.

vLLM's extras are read in both spellings it has had: ``structured_outputs: {"json" |
"regex" | "choice" | "grammar" | "json_object": ...}`` and the older top-level
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. A request may
carry one constraint; a second is refused naming it. Every failure is a ``FieldError``
naming the body field; whether the constraint compiles is checked with the other
sampling parameters (``gateway.validation.check_constraint_compiles``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.constraint import Constraint, ConstraintKind
from gateway.validation import FieldError, make_constraint, schema_constraint
from gateway.validation import json_kind as _kind

# Top-level body fields this module reads.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)
_STRUCTURED_KEYS = {
    "json": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "choice": ConstraintKind.CHOICE,
    "grammar": ConstraintKind.GRAMMAR,
    "json_object": ConstraintKind.JSON_OBJECT,
}
_GUIDED_KINDS = {
    "guided_json": ConstraintKind.JSON_SCHEMA,
    "guided_regex": ConstraintKind.REGEX,
    "guided_choice": ConstraintKind.CHOICE,
    "guided_grammar": ConstraintKind.GRAMMAR,
}


def request_constraint(b: Mapping[str, Any]) -> tuple[Constraint, str] | None:
    """The body's constraint and the field path that carried it, or None."""
    found: list[tuple[Constraint, str]] = []
    if "response_format" in b:
        found += _response_format(b["response_format"])
    if "structured_outputs" in b:
        found += _structured_outputs(b["structured_outputs"])
    for name, kind in _GUIDED_KINDS.items():
        if name in b:
            found.append((_build(kind, b[name], name), name))
    if len(found) > 1:
        first, second = found[0][1], found[1][1]
        raise FieldError(
            second, f"{second} sets a second output constraint; {first} already sets one"
        )
    return found[0] if found else None


def _response_format(value: object) -> list[tuple[Constraint, str]]:
    path = "response_format"
    if not isinstance(value, Mapping):
        raise FieldError(path, f"{path} must be an object, got {_kind(value)}")
    kind = value.get("type")
    allowed_keys = {
        "text": {"type"},
        "json_object": {"type"},
        "json_schema": {"type", "json_schema"},
    }
    if kind not in allowed_keys:
        raise FieldError(
            f"{path}.type",
            f"{path}.type must be one of text, json_object, json_schema, got {kind!r}",
        )
    for key in value:
        if key not in allowed_keys[kind]:
            raise FieldError(f"{path}.{key}", f"{path}.{key} is not allowed with type {kind}")
    if kind == "text":
        return []
    if kind == "json_object":
        return [(Constraint(ConstraintKind.JSON_OBJECT), path)]
    spec = value.get("json_schema")
    path = f"{path}.json_schema"
    if not isinstance(spec, Mapping):
        raise FieldError(path, f"{path} must be an object with a schema, got {_kind(spec)}")
    for key in spec:
        if key not in ("name", "schema", "strict", "description"):
            raise FieldError(f"{path}.{key}", f"{path}.{key} is not a json_schema field")
    for key, kinds in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise FieldError(f"{path}.{key}", f"{path}.{key} must be a {kinds.__name__}")
    if "schema" not in spec:
        raise FieldError(f"{path}.schema", f"{path}.schema is required")
    # strict or not, the schema is enforced: every token is masked by it.
    return [(schema_constraint(spec["schema"], f"{path}.schema"), f"{path}.schema")]


def _structured_outputs(value: object) -> list[tuple[Constraint, str]]:
    path = "structured_outputs"
    if not isinstance(value, Mapping):
        raise FieldError(path, f"{path} must be an object, got {_kind(value)}")
    found = []
    for key, item in value.items():
        if item is None:
            continue
        if key not in _STRUCTURED_KEYS:
            raise FieldError(
                f"{path}.{key}",
                f"{path}.{key} is not supported; use one of {', '.join(_STRUCTURED_KEYS)}",
            )
        kind = _STRUCTURED_KEYS[key]
        if kind is ConstraintKind.JSON_OBJECT:
            if item is not True and item is not False:
                raise FieldError(f"{path}.{key}", f"{path}.{key} must be a boolean")
            if item:
                found.append((Constraint(kind), f"{path}.{key}"))
            continue
        found.append((_build(kind, item, f"{path}.{key}"), f"{path}.{key}"))
    return found


def _build(kind: ConstraintKind, value: object, path: str) -> Constraint:
    if kind is ConstraintKind.JSON_SCHEMA:
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise FieldError(path, f"{path} is not valid JSON: {exc}") from exc
        return schema_constraint(value, path)
    if kind is ConstraintKind.CHOICE:
        if not isinstance(value, list):
            raise FieldError(path, f"{path} must be a list of strings, got {_kind(value)}")
        return make_constraint(kind, path, choices=tuple(value))
    if not isinstance(value, str):
        raise FieldError(path, f"{path} must be a string, got {_kind(value)}")
    return make_constraint(kind, path, spec=value)
