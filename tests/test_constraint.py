"""Constraints without a model: their shape (engine.constraint), whether they compile
(engine.grammar, compile bounds included), their wire form (rpc.convert_constraint) and
the OpenAI body fields that carry them (gateway.http.constraint)."""

from __future__ import annotations

import json

import pytest
import torch

import engine.grammar as grammar
from engine.constraint import MAX_CHOICES, MAX_SPEC_CHARS, Constraint, ConstraintKind
from engine.guided import GuidedDecoding, GuidedRow
from engine.request import Request
from engine.sampling_params import SamplingParams
from gateway.http.constraint import request_constraint
from gateway.validation import FieldError
from protos.baton.v1 import common_pb2
from rpc.convert import sampling_params_from_proto, sampling_params_to_proto

K = ConstraintKind
ALL_KINDS = [
    Constraint(K.JSON_SCHEMA, '{"type":"integer"}'),
    Constraint(K.JSON_OBJECT),
    Constraint(K.REGEX, "[a-z]+"),
    Constraint(K.CHOICE, choices=('say "hi"', "back\\slash")),
    Constraint(K.GRAMMAR, 'start: "a" "b"*'),
    Constraint(K.GRAMMAR, 'root ::= "x" [0-9]'),
]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": K.REGEX}, "regex must be a non-empty string"),
        ({"kind": K.GRAMMAR, "spec": "x" * (MAX_SPEC_CHARS + 1)}, "grammar has 65537 characters"),
        ({"kind": K.CHOICE}, "choice must list at least one string"),
        ({"kind": K.CHOICE, "choices": ("a", "")}, r"choice\[1\] must be a non-empty string"),
        ({"kind": K.CHOICE, "choices": ("a",) * (MAX_CHOICES + 1)}, "choice has 257 entries"),
        ({"kind": K.JSON_OBJECT, "spec": "{}"}, "json_object takes no spec"),
        ({"kind": K.REGEX, "spec": "a", "choices": ("a",)}, "regex takes no choices"),
    ],
)
def test_shape_is_checked_and_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        Constraint(**fields)


@pytest.mark.parametrize("constraint", ALL_KINDS, ids=lambda c: c.kind.value)
def test_every_kind_compiles_and_round_trips_the_wire(constraint: Constraint) -> None:
    grammar.check_constraint(constraint)
    params = SamplingParams(max_tokens=5, constraint=constraint)
    wire = sampling_params_to_proto(params).SerializeToString()
    assert sampling_params_from_proto(common_pb2.SamplingParameters.FromString(wire)) == params


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint(K.JSON_SCHEMA, "{nope"), "json_schema is not valid JSON"),
        (Constraint(K.JSON_SCHEMA, '{"type": "nope"}'), "json_schema does not compile: Invalid"),
        (
            Constraint(K.JSON_SCHEMA, '{"unevaluatedProperties": false}'),
            "json_schema does not compile: Unimplemented keys",
        ),
        (Constraint(K.REGEX, "(a"), "regex does not compile: .*unclosed group"),
        (Constraint(K.GRAMMAR, "start: foo"), "grammar does not compile: .*unknown name"),
        (Constraint(K.GRAMMAR, "root ::= ("), "grammar is not valid GBNF"),
    ],
)
def test_what_does_not_compile_is_named(constraint: Constraint, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        grammar.check_constraint(constraint)


def test_a_grammar_past_the_compile_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40)}}
    big = Constraint(K.JSON_SCHEMA, json.dumps(schema))
    monkeypatch.setitem(grammar.LIMITS, "max_grammar_size", 50)
    grammar.check_constraint.cache_clear()
    try:
        with pytest.raises(ValueError, match="^json_schema does not compile: grammar size"):
            grammar.check_constraint(big)
    finally:
        grammar.check_constraint.cache_clear()


def test_malformed_wire_constraints_name_their_field() -> None:
    with pytest.raises(ValueError, match=r"^sampling_params\.regex must be a non-empty"):
        sampling_params_from_proto(common_pb2.SamplingParameters(regex=""))
    too_many = common_pb2.ChoiceList(choices=["a"] * (MAX_CHOICES + 1))
    with pytest.raises(ValueError, match=r"^sampling_params\.choice has 257 entries"):
        sampling_params_from_proto(common_pb2.SamplingParameters(choice=too_many))
    off = sampling_params_from_proto(common_pb2.SamplingParameters(json_object=False))
    assert off.constraint is None


def test_openai_fields_map_to_one_constraint() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    reordered = dict(reversed(list(schema.items())))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    got, path = request_constraint({"response_format": fmt}) or (None, "")
    assert path == "response_format.json_schema.schema"
    assert got is not None and json.loads(got.spec) == schema
    # Key order does not matter: one canonical text, so one compile.
    again, _ = request_constraint({"guided_json": json.dumps(reordered)}) or (None, "")
    assert again == got
    assert request_constraint({"response_format": {"type": "text"}}) is None
    assert request_constraint({"structured_outputs": {"json_object": False}}) is None
    regex, path = request_constraint({"structured_outputs": {"regex": "[0-9]+"}}) or (None, "")
    assert regex == Constraint(K.REGEX, "[0-9]+") and path == "structured_outputs.regex"
    with pytest.raises(FieldError) as two:
        request_constraint({"guided_regex": "a", "guided_choice": ["b"]})
    assert two.value.field == "guided_choice"


class _RefusingCompiler:
    vocab_size = 64

    def matcher(self, constraint: Constraint) -> None:
        raise ValueError("regex does not compile here")


def test_a_worker_that_cannot_compile_lets_that_request_only_end() -> None:
    eos = 2
    guided = GuidedDecoding(_RefusingCompiler, 70, [eos], torch.device("cpu"))  # type: ignore[arg-type]
    params = SamplingParams(constraint=Constraint(K.REGEX, "a+"))
    req = Request("r", [1, 2, 3], params)
    masks = guided.masks([GuidedRow(4, req, [])])
    assert masks is not None and masks.rows == [4]
    assert masks.allowed[0].nonzero().flatten().tolist() == [eos]
    guided.close()
