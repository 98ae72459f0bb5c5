"""rpc.convert: proto <-> engine records round-trip, and bad wire values name their field."""

from __future__ import annotations

import math

import pytest

from engine.kv_layout import KVLayout
from engine.request import FinishReason, RequestOutput, RequestTimings, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.transfer.handoff import TransferDone
from protos.baton.v1 import common_pb2, kv_pb2, worker_pb2
from rpc import convert
from rpc.convert_handoff import prefill_event_from_proto, prefill_event_to_proto


def full_params() -> SamplingParams:
    return SamplingParams(
        max_tokens=77,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        seed=2**62,
        min_tokens=3,
        stop_token_ids=(2, 13),
        ignore_eos=True,
        logprobs=5,
        repetition_penalty=1.1,
        presence_penalty=-0.5,
        frequency_penalty=1.5,
    )


def logprob(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.125 * token_id, 1, [(token_id, -0.125), (9, -3.5)])


# --- sampling parameters -------------------------------------------------------------


def test_unset_proto_gives_dataclass_defaults() -> None:
    assert convert.sampling_params_from_proto(common_pb2.SamplingParameters()) == SamplingParams()


def test_partial_proto_keeps_other_defaults() -> None:
    msg = common_pb2.SamplingParameters(temperature=0.0, max_tokens=5)
    assert convert.sampling_params_from_proto(msg) == SamplingParams(temperature=0.0, max_tokens=5)


def test_explicit_zero_is_not_unset() -> None:
    # temperature=0 (greedy) differs from the default 1.0; `optional` keeps it.
    params = convert.sampling_params_from_proto(common_pb2.SamplingParameters(temperature=0.0))
    assert params.greedy


@pytest.mark.parametrize("params", [SamplingParams(), full_params()])
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    wire = convert.sampling_params_to_proto(params).SerializeToString()
    back = convert.sampling_params_from_proto(common_pb2.SamplingParameters.FromString(wire))
    assert back == params


def test_to_proto_sets_every_field_but_none() -> None:
    msg = convert.sampling_params_to_proto(SamplingParams())
    assert msg.HasField("max_tokens") and msg.HasField("temperature")
    assert not msg.HasField("seed") and not msg.HasField("logprobs")


def test_every_sampling_field_is_on_the_wire() -> None:
    import dataclasses

    descriptor = common_pb2.SamplingParameters.DESCRIPTOR
    constraint = descriptor.oneofs_by_name["constraint"]
    # The constraint is one field in SamplingParams and a oneof of its kinds on the wire.
    wire = set(descriptor.fields_by_name) - {f.name for f in constraint.fields} | {"constraint"}
    assert {f.name for f in dataclasses.fields(SamplingParams)} == wire


INVALID = [
    ("max_tokens", {"max_tokens": 0}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("min_p", {"min_p": 2.0}),
    ("seed", {"seed": 2**63}),
    ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
    ("stop_token_ids", {"stop_token_ids": list(range(65))}),
    ("logprobs", {"logprobs": 21}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
]


@pytest.mark.parametrize(("field", "values"), INVALID, ids=[f for f, _ in INVALID])
def test_invalid_proto_value_names_the_field(field: str, values: dict) -> None:
    msg = common_pb2.SamplingParameters(**values)
    with pytest.raises(ValueError, match=rf"^sampling_params\.{field}\b"):
        convert.sampling_params_from_proto(msg)


def test_error_path_is_the_callers() -> None:
    msg = common_pb2.SamplingParameters(max_tokens=0)
    with pytest.raises(ValueError, match=r"^request\.sampling_params\.max_tokens"):
        convert.sampling_params_from_proto(msg, path="request.sampling_params")


# --- finish reasons, logprobs, outputs -----------------------------------------------


@pytest.mark.parametrize("reason", [None, *FinishReason])
def test_finish_reason_round_trip(reason: FinishReason | None) -> None:
    assert convert.finish_reason_from_proto(convert.finish_reason_to_proto(reason)) is reason


def test_every_engine_finish_reason_has_a_proto_value() -> None:
    values = {convert.finish_reason_to_proto(r) for r in FinishReason}
    assert common_pb2.FINISH_REASON_UNSPECIFIED not in values
    assert len(values) == len(FinishReason)


def test_stop_string_reads_as_stop_and_unknown_is_rejected() -> None:
    assert convert.finish_reason_from_proto(common_pb2.FINISH_REASON_STOP_STRING) is (
        FinishReason.STOP
    )
    with pytest.raises(ValueError, match="finish_reason"):
        convert.finish_reason_from_proto(99)


def test_token_logprob_round_trip() -> None:
    lp = logprob(7)
    assert convert.token_logprob_from_proto(convert.token_logprob_to_proto(lp)) == lp


@pytest.mark.parametrize(
    "out",
    [
        RequestOutput("r1", [5, 6]),
        RequestOutput("r1", [5], logprobs=[logprob(5)]),
        RequestOutput(
            "r1",
            [8],
            logprobs=[logprob(8)],
            finish_reason=FinishReason.LENGTH,
            num_prompt_tokens=12,
            num_cached_tokens=4,
        ),
        RequestOutput("r1", [], finish_reason=FinishReason.ABORT, num_prompt_tokens=3),
        RequestOutput("r1", [5], timings=RequestTimings(reserved_s=0.0, first_token_s=0.25)),
    ],
)
def test_decode_response_round_trip(out: RequestOutput) -> None:
    msg = convert.decode_response_from_output(out, completion_tokens=9)
    wire = worker_pb2.DecodeResponse.FromString(msg.SerializeToString())
    assert convert.output_from_decode_response("r1", wire) == out
    assert wire.HasField("usage") == out.finished


def test_usage_only_on_the_last_response() -> None:
    last = RequestOutput(
        "r", [1], finish_reason=FinishReason.STOP, num_prompt_tokens=10, num_cached_tokens=8
    )
    msg = convert.decode_response_from_output(last, completion_tokens=4)
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens) == (
        10,
        4,
        8,
    )
    assert msg.finish_reason == common_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize("with_logprob", [False, True])
def test_first_token_round_trip(with_logprob: bool) -> None:
    out = RequestOutput(
        "p1",
        [42],
        logprobs=[logprob(42)] if with_logprob else None,
        num_prompt_tokens=30,
        num_cached_tokens=16,
    )
    msg = convert.first_token_from_output(out)
    assert msg.HasField("logprob") == with_logprob
    assert convert.output_from_first_token("p1", msg, num_prompt_tokens=30) == out


def test_first_token_needs_exactly_one_token() -> None:
    with pytest.raises(ValueError, match="exactly one token"):
        convert.first_token_from_output(RequestOutput("p1", [1, 2]))


# --- KV layout -----------------------------------------------------------------------


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_kv_layout_round_trip(dtype: str, deterministic: bool) -> None:
    layout = KVLayout(
        num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype,
        deterministic=deterministic,
    )  # fmt: skip
    msg = convert.kv_layout_to_proto(layout)
    assert convert.kv_layout_from_proto(kv_pb2.KVLayout.FromString(msg.SerializeToString())) == (
        layout
    )


@pytest.mark.parametrize("field", ["num_layers", "block_size", "num_kv_heads", "head_dim", "dtype"])
def test_kv_layout_missing_field_is_named(field: str) -> None:
    msg = convert.kv_layout_to_proto(KVLayout(2, 16, 2, 8, "float32"))
    msg.ClearField(field)
    with pytest.raises(ValueError, match=rf"^kv\.layout\.{field}\b"):
        convert.kv_layout_from_proto(msg, path="kv.layout")


# --- timings ---------------------------------------------------------------------------


def test_timings_round_trip_keeps_unknown_phases_unset() -> None:
    timings = RequestTimings(queued_s=0.0, prefill_s=0.5, transfer_s=1e-6, total_s=3.0)
    wire = common_pb2.RequestTimings.FromString(
        convert.request_timings_to_proto(timings).SerializeToString()
    )
    assert not wire.HasField("reserved_s") and wire.HasField("queued_s")
    assert convert.request_timings_from_proto(wire) == timings


@pytest.mark.parametrize("value", [-0.5, math.inf, math.nan])
def test_a_bad_timing_names_its_field(value: float) -> None:
    with pytest.raises(ValueError, match=r"^transfer_complete\.timings\.decode_s must be"):
        convert.request_timings_from_proto(
            common_pb2.RequestTimings(decode_s=value), path="transfer_complete.timings"
        )


def test_timings_merge_newer_known_phases_only() -> None:
    old = RequestTimings(queued_s=1.0, reserved_s=2.0)
    assert old.merged(RequestTimings(reserved_s=3.0, decode_s=4.0)) == RequestTimings(
        queued_s=1.0, reserved_s=3.0, decode_s=4.0
    )
    assert old.merged(None) is old
    assert old.as_dict() == {"queued_s": 1.0, "reserved_s": 2.0}


def test_transfer_done_carries_prefills_timings() -> None:
    timings = RequestTimings(queued_s=0.01, prefill_s=0.2, transfer_s=0.003)
    for done in (TransferDone(9, 2, 4096, b"mac", timings), TransferDone(9, 2, 4096)):
        msg = prefill_event_to_proto("r1", done)
        wire = worker_pb2.PrefillServerMessage.FromString(msg.SerializeToString())
        assert prefill_event_from_proto(wire) == done
