"""What a constrained request asks its output to match: a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a grammar.

A plain record, torch- and library-free: the gateway builds it from the wire, it travels in
``SamplingParams`` (so the hand-off's fleet tag covers it, ``engine.transfer.canonical``),
and ``engine.grammar`` compiles it. This module checks only its shape and size; whether a
schema or grammar compiles is ``engine.grammar.check_constraint``'s to say.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Bounds on what a client may send, checked before anything is compiled.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; no spec
    REGEX = "regex"  # spec: a regular expression (Rust ``regex`` syntax), matched whole
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # spec: a Lark-style grammar (llguidance), or GBNF (``::=`` rules)


@dataclass(frozen=True, slots=True)
class Constraint:
    """The output must match this; the engine masks every token that could not."""

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        name = self.kind.value
        if self.kind is ConstraintKind.CHOICE:
            if self.spec:
                raise ValueError("choice takes a list of strings, not a spec")
            if not self.choices:
                raise ValueError("choice must list at least one string")
            if len(self.choices) > MAX_CHOICES:
                raise ValueError(
                    f"choice has {len(self.choices)} entries; at most {MAX_CHOICES} allowed"
                )
            for i, choice in enumerate(self.choices):
                if not isinstance(choice, str) or not choice:
                    raise ValueError(f"choice[{i}] must be a non-empty string, got {choice!r}")
                if len(choice) > MAX_CHOICE_CHARS:
                    raise ValueError(
                        f"choice[{i}] has {len(choice)} characters; at most "
                        f"{MAX_CHOICE_CHARS} allowed"
                    )
            return
        if self.choices:
            raise ValueError(f"{name} takes no choices")
        if self.kind is ConstraintKind.JSON_OBJECT:
            if self.spec:
                raise ValueError("json_object takes no spec")
            return
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"{name} must be a non-empty string")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"{name} has {len(self.spec)} characters; at most {MAX_SPEC_CHARS} allowed"
            )

    @property
    def field(self) -> str:
        """The name of the field that carries this constraint (proto and vLLM's body)."""
        return self.kind.value
