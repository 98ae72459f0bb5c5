"""logit_bias: checked once at the edge (HTTP and gRPC), carried on the wire and across the
prefill/decode split, applied in the batched sampler to the rows that ask for it only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.device_sampler import DeviceSampler
from engine.request import RequestOutput
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from gateway.grpc_api.request import validate_generate_request
from gateway.http.request import Endpoint, parse_request
from gateway.routing.migration import StreamProgress
from gateway.validation import FieldError
from protos.baton.v1 import common_pb2, generate_pb2
from protos.client.messages import SamplingParams as ClientSamplingParams
from rpc.convert import sampling_params_from_proto, sampling_params_to_proto
from tests.engine_helpers import make_core
from tests.test_openai_request import CARD
from tests.test_seeded_split import PROMPT, _run, _split

V = 50
CPU = torch.device("cpu")


def _row(params: SamplingParams, gen: torch.Generator | None = None) -> SamplingRow:
    return SamplingRow(params, 5, frozenset({2}), gen, None, 0)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


# -- the record -------------------------------------------------------------------------------


def test_the_record_keeps_one_canonical_order() -> None:
    a = SamplingParams(logit_bias=((9, 1), (3, -100)))
    b = SamplingParams(logit_bias=((3, -100.0), (9, 1.0)))
    assert a == b and a.logit_bias == ((3, -100.0), (9, 1.0))
    assert isinstance(a.logit_bias[1][1], float)


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        (((5, 100.5),), r"logit_bias\[5\] must be in \[-100, 100\]"),
        (((5, float("nan")),), r"logit_bias\[5\] must be finite"),
        (((-1, 1.0),), "logit_bias token id must be >= 0"),
        (((5, 1.0), (5, 2.0)), "logit_bias names token 5 more than once"),
        (((5, "x"),), r"logit_bias\[5\] must be a number"),
        (tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)), "at most 300 allowed"),
    ],
)
def test_bad_biases_are_refused_naming_the_field(bias: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_a_token_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match=r"logit_bias names token 50, outside .*\[0, 50\)"):
        SamplingParams(logit_bias=((50, 1.0),)).validate_vocab(V)


# -- the sampler ------------------------------------------------------------------------------


def test_minus_100_bans_the_argmax_and_plus_100_forces_a_token() -> None:
    logits = _logits(1, seed=1)
    top = int(logits.argmax())
    banned = SamplingParams(temperature=0, logit_bias=((top, -100),))
    out = Sampler(CPU, 0)(logits, [_row(banned)])
    assert out[0][0] != top and out[0][0] == int(logits[0].topk(2).indices[1])
    low = int(logits.argmin())
    forced = SamplingParams(temperature=1.0, logit_bias=((low, 100),))
    draws = Sampler(CPU, 0)(logits.repeat(8, 1), [_row(forced)] * 8)
    assert {t for t, _ in draws} == {low}


def test_rows_without_bias_sample_exactly_as_alone() -> None:
    logits = _logits(4, seed=2)
    free = SamplingParams(temperature=0.9, seed=5)
    biased = SamplingParams(temperature=0.9, seed=6, logit_bias=((0, 100), (1, -100)))
    alone = [
        Sampler(CPU, 0)(logits[i : i + 1], [_row(free, torch.Generator().manual_seed(i))])[0][0]
        for i in (0, 2)
    ]
    rows = [_row(free, torch.Generator().manual_seed(0)), _row(biased)] * 2
    rows[2] = _row(free, torch.Generator().manual_seed(2))
    mixed = Sampler(CPU, 0)(logits, rows)
    assert [mixed[0][0], mixed[2][0]] == alone
    assert mixed[1][0] == mixed[3][0] == 0
    # The logits the model produced are untouched (logprobs report the model's view).
    assert torch.equal(logits, _logits(4, seed=2))


def test_the_device_sampler_applies_the_bias_too() -> None:
    logits = _logits(3, seed=3)
    top = logits.argmax(-1).tolist()
    rows = [_row(SamplingParams(temperature=0, logit_bias=((t, -100),))) for t in top]
    out = DeviceSampler(CPU, 0)(logits, rows)
    assert all(t != banned for (t, _), banned in zip(out, top, strict=True))


# -- the wire and the edges -------------------------------------------------------------------


def test_the_proto_round_trips_and_counts_before_copying() -> None:
    params = SamplingParams(temperature=0, logit_bias=((7, -100), (3, 2.5)))
    msg = sampling_params_to_proto(params)
    assert dict(msg.logit_bias) == {3: 2.5, 7: -100.0}
    assert sampling_params_from_proto(msg) == params
    big = common_pb2.SamplingParameters(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    with pytest.raises(ValueError, match=r"^sampling_params\.logit_bias has 301 entries"):
        sampling_params_from_proto(big)
    bad = common_pb2.SamplingParameters(logit_bias={3: 101.0})
    with pytest.raises(ValueError, match=r"^sampling_params\.logit_bias\[3\] must be in"):
        sampling_params_from_proto(bad)


def test_the_grpc_edge_checks_the_vocabulary() -> None:
    request = generate_pb2.GenerateRequest(
        text="hi",
        sampling_params=ClientSamplingParams(logit_bias={CARD.vocab_size: -100}).to_proto(),
    )
    with pytest.raises(FieldError) as err:
        validate_generate_request(request, CARD)
    assert err.value.field == "sampling_params.logit_bias"
    assert "outside the vocabulary [0, 1000)" in str(err.value)
    request.sampling_params.logit_bias.pop(CARD.vocab_size)
    request.sampling_params.logit_bias[999] = 5
    assert validate_generate_request(request, CARD).params.logit_bias == ((999, 5.0),)


@pytest.mark.parametrize("endpoint", [Endpoint.COMPLETIONS, Endpoint.CHAT])
def test_the_openai_edge_reads_string_keys(endpoint: Endpoint) -> None:
    body: dict = {"model": "m", "logit_bias": {"12": -100, "4": 0.5}}
    body |= (
        {"prompt": "hi"}
        if endpoint is Endpoint.COMPLETIONS
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    params = parse_request(endpoint, body, CARD, None).input.params
    assert params.logit_bias == ((4, 0.5), (12, -100.0))
    body["logit_bias"] = {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(FieldError, match="at most 300 allowed") as err:
        parse_request(endpoint, body, CARD, None)
    assert err.value.field == "logit_bias"


# -- the engine, whole and split --------------------------------------------------------------


def test_a_banned_token_is_never_picked_on_either_side_of_the_split(tiny_llama: Path) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    free = _run(make_core(tiny_llama), "free", PROMPT, greedy)
    # Ban the first token (sampled by the prefill worker) and one the decode worker picks.
    ban = {free[0], free[3]}
    biased = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logit_bias=tuple((t, -100) for t in ban)
    )
    whole = _run(make_core(tiny_llama), "b", PROMPT, biased)
    split = _split(make_core(tiny_llama), make_core(tiny_llama), "b", PROMPT, biased)
    assert split == whole
    assert not ban & set(whole) and whole[0] != free[0]


def test_an_unbiased_request_beside_a_biased_one_is_unchanged(tiny_llama: Path) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = _run(make_core(tiny_llama), "a", PROMPT, greedy)
    core = make_core(tiny_llama)
    biased = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias=((alone[0], -100),)
    )
    core.add_request(core.make_request("a", PROMPT, greedy))
    core.add_request(core.make_request("b", PROMPT, biased))
    out: dict[str, list[int]] = {"a": [], "b": []}
    while core.has_work():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    assert out["a"] == alone
    assert out["b"][0] != alone[0]


def test_the_bias_survives_a_move_between_decode_workers() -> None:
    params = SamplingParams(max_tokens=5, logit_bias=((3, -100),))
    progress = StreamProgress((1, 2), params)
    progress.record(RequestOutput("r", [7, 8]))
    prompt, resumed = progress.resume()
    assert prompt == [1, 2, 7, 8] and resumed.logit_bias == ((3, -100.0),)
    assert sampling_params_from_proto(sampling_params_to_proto(resumed)) == resumed
