"""The constraint part of the proto/domain mapping: ``SamplingParameters``' ``constraint``
oneof <-> ``engine.constraint.Constraint``. Reading checks shape and size and names the
field (``sampling_params.json_schema``); whether it compiles is the gateway's check
(``engine.grammar.check_constraint``), and the worker's again on admission.
"""

from __future__ import annotations

from engine.constraint import MAX_CHOICES, Constraint, ConstraintKind
from protos.baton.v1 import common_pb2

_STRING_FIELDS = {
    "json_schema": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "grammar": ConstraintKind.GRAMMAR,
}


def constraint_from_proto(
    msg: common_pb2.SamplingParameters, *, path: str = "sampling_params"
) -> Constraint | None:
    """The message's constraint (None when unset, or ``json_object: false``); ValueError
    naming ``path.<field>`` when it is malformed."""
    which = msg.WhichOneof("constraint")
    if which is None or (which == "json_object" and not msg.json_object):
        return None
    try:
        if which == "json_object":
            return Constraint(ConstraintKind.JSON_OBJECT)
        if which == "choice":
            count = len(msg.choice.choices)
            if count > MAX_CHOICES:  # counted before it is copied
                raise ValueError(f"choice has {count} entries; at most {MAX_CHOICES} allowed")
            return Constraint(ConstraintKind.CHOICE, choices=tuple(msg.choice.choices))
        return Constraint(_STRING_FIELDS[which], getattr(msg, which))
    except ValueError as exc:
        raise ValueError(f"{path}.{exc}") from exc


def constraint_to_proto(constraint: Constraint | None, msg: common_pb2.SamplingParameters) -> None:
    """Set ``msg``'s constraint oneof from ``constraint`` (nothing when None)."""
    if constraint is None:
        return
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        msg.json_object = True
    elif kind is ConstraintKind.CHOICE:
        msg.choice.choices.extend(constraint.choices)
    else:
        setattr(msg, kind.value, constraint.spec)
