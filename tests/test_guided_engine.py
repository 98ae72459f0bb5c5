"""Constrained decoding in the engine (engine.guided, the sampler's masks), on the tiny
random Llama with SmolLM2's tokenizer: a random model's output is valid only because the
mask forces it.

Across the split: one ``EngineCore`` plays the prefill worker (samples the first token
under the constraint, holds the KV), a second the decode worker (rebuilds the matcher and
advances it by the first token before it samples), as in tests/test_seeded_split.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from engine.constraint import Constraint, ConstraintKind
from engine.engine_core import EngineCore
from engine.model_files import load_tokenizer, resolve_model
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core

PROMPT = [5, 17, 923, 4401, 12, 77, 3001, 8, 64, 1000, 2, 9, 31, 4, 88, 19, 7, 6]
EOS = 2
# The first token is forced ('{"' is the only one the mask allows at position 0) ...
FORCED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
}
# ... and here it is not (any digit, '-', '"', ...).
FREE_FIRST = {"anyOf": [{"type": "integer"}, {"enum": ["red", "green", "blue"]}]}


def _schema(schema: dict) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


@pytest.fixture(scope="module")
def core(tiny_llama: Path) -> EngineCore:
    return make_core(tiny_llama)


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201 - an HF tokenizer
    return load_tokenizer(resolve_model("smollm2-135m"))


def _text(tok, ids: list[int]) -> str:  # noqa: ANN001
    assert ids and ids[-1] == EOS, f"the constraint did not complete: {ids}"
    return tok.decode(ids[:-1])


def _run(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    core.add_request(core.make_request(rid, prompt, params))
    out: list[int] = []
    while core.has_work():
        for o in core.step():
            if o.request_id == rid:
                out.extend(o.new_token_ids)
    return out


def _split(
    prefill: EngineCore, decode: EngineCore, rid: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    first_params = dataclasses.replace(params, max_tokens=1)
    prefill.add_request(prefill.make_request(rid, prompt, first_params, hold_kv=True))
    first = held = None
    while prefill.has_work():
        for o in prefill.step():
            if o.request_id == rid and o.finished:
                first, held = o.new_token_ids[0], o.held_block_ids
    assert first is not None and held is not None
    req = decode.make_request(rid, prompt, params)
    dst = decode.scheduler.reserve_remote(req)
    decode.runner.kv_cache[:, :, :, dst] = prefill.runner.kv_cache[:, :, :, held]
    prefill.scheduler.release_held(rid)
    assert decode.scheduler.remote_kv_ready(rid, first) is None
    rest: list[int] = []
    while decode.has_work():
        for o in decode.step():
            if o.request_id == rid:
                rest.extend(o.new_token_ids)
    return [first, *rest]


def test_each_kind_constrains_greedy_and_sampled_output(core: EngineCore, tok) -> None:  # noqa: ANN001
    kinds = [
        _schema(FORCED),
        Constraint(ConstraintKind.JSON_OBJECT),
        Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]{2}"),
        Constraint(ConstraintKind.CHOICE, choices=("yes", 'no "way"')),
        Constraint(ConstraintKind.GRAMMAR, 'root ::= "(" abc abc? ")"\nabc ::= [a-c]'),
    ]
    for temperature, seed in ((0.0, None), (1.0, 11)):
        params = [
            SamplingParams(max_tokens=48, temperature=temperature, seed=seed, constraint=c)
            for c in kinds
        ]
        outs = core.generate([PROMPT] * len(kinds), params)
        value = json.loads(_text(tok, outs[0]))
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 99
        # json_object: a random model may not close the object within 48 tokens; what it
        # wrote is still an object's prefix.
        assert tok.decode(outs[1]).startswith("{")
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _text(tok, outs[2]))
        assert _text(tok, outs[3]) in ("yes", 'no "way"')
        assert re.fullmatch(r"\([a-c]{1,2}\)", _text(tok, outs[4]))


def test_free_rows_draw_what_they_draw_alone(core: EngineCore) -> None:
    free = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True),
    ]
    alone = core.generate([PROMPT, PROMPT[:9]], free)
    constrained = SamplingParams(max_tokens=20, temperature=0.0, constraint=_schema(FORCED))
    mixed = core.generate(
        [PROMPT, PROMPT[:9], PROMPT, PROMPT[3:]],
        [free[0], free[1], constrained, constrained],
    )
    assert mixed[:2] == alone
    assert mixed[2][0] != alone[0][0]  # the mask did bite on the constrained row


@pytest.mark.parametrize("schema", [FORCED, FREE_FIRST], ids=["forced-first", "free-first"])
@pytest.mark.parametrize("temperature", [0.0, 1.2], ids=["greedy", "seeded"])
def test_split_sees_the_state_one_engine_sees(
    tiny_llama: Path, core: EngineCore, schema: dict, temperature: float
) -> None:
    params = SamplingParams(
        max_tokens=40, temperature=temperature, seed=77, constraint=_schema(schema)
    )
    whole = _run(core, f"whole-{temperature}", PROMPT, params)
    decode = make_core(tiny_llama, seed=3)
    split = _split(make_core(tiny_llama, seed=2), decode, "s", PROMPT, params)
    assert split == whole
    # The decode side's matcher took the prefill side's first token, then its own; after
    # its first step each next mask was filled on the side thread while the forward ran.
    guided = decode.runner.guided
    assert guided.num_masked_rows == len(whole) - 1
    assert guided.num_masks_ahead == guided.num_masked_rows - 1


def test_a_moved_request_resumes_the_constraint(core: EngineCore) -> None:
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=4, constraint=_schema(FORCED))
    whole = _run(core, "m-whole", PROMPT, params)
    k = 3
    moved = dataclasses.replace(params, max_tokens=params.max_tokens - k, output_offset=k)
    rest = _run(core, "m-moved", PROMPT + whole[:k], moved)
    assert whole[:k] + rest == whole


def test_a_first_token_outside_the_constraint_only_ends_that_request(
    tiny_llama: Path, core: EngineCore
) -> None:
    """A prefill peer that sampled without the constraint: decode's matcher cannot take
    the token, so that request may only end; a free request beside it is untouched."""
    params = SamplingParams(max_tokens=30, temperature=0.0, constraint=_schema(FORCED))
    decode = make_core(tiny_llama)
    req = decode.make_request("bad", PROMPT, params)
    decode.scheduler.reserve_remote(req)
    assert decode.scheduler.remote_kv_ready("bad", 9) is None  # '9' cannot start an object
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    decode.add_request(decode.make_request("free", PROMPT[:7], free))
    out: dict[str, list[int]] = {"bad": [], "free": []}
    while decode.has_work():
        for o in decode.step():
            out[o.request_id].extend(o.new_token_ids)
    assert out["bad"] == [EOS]
    assert out["free"] == core.generate([PROMPT[:7]], free)[0]


def test_admission_refuses_a_constraint_that_does_not_compile(core: EngineCore) -> None:
    bad = SamplingParams(constraint=Constraint(ConstraintKind.REGEX, "[0-9"))
    with pytest.raises(ValueError, match="^regex does not compile"):
        core.make_request("r", PROMPT, bad)
