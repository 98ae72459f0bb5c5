"""``echo`` with prompt logprobs on /v1/completions, and ``prompt_logprobs`` on gRPC: checked
at the edge, carried with the first token (prefill -> decode -> gateway), shaped as OpenAI
returns them (the prompt first, its first token with ``null``). A real gateway in front of
a fake decode worker; the engine's values themselves are tested in test_prompt_logprobs.py
and end to end in test_e2e_surface.py."""

from __future__ import annotations

import grpc
import pytest

from engine.request import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.transfer.handoff import FirstToken
from gateway.http.request import Endpoint, parse_request
from gateway.routing.migration import StreamProgress
from gateway.served_model import ServedModel
from gateway.validation import FieldError
from protos.baton.v1 import generate_pb2, generate_pb2_grpc
from protos.client.messages import SamplingParams as ClientSamplingParams
from rpc import convert
from rpc.convert_handoff import prefill_event_from_proto, prefill_event_to_proto
from tests.fake_workers import FakeDecodeWorker, Script, fake_workers
from tests.http_helpers import MODEL, ids_of, post, running_http
from tests.test_openai_request import CARD

LP = TokenLogprob(5, -0.25, 2, [(9, -0.125)])


def test_echo_asks_for_prompt_logprobs_with_the_same_count() -> None:
    body = {"model": "m", "prompt": "hi", "echo": True, "logprobs": 2}
    req = parse_request(Endpoint.COMPLETIONS, body, CARD, None)
    assert req.echo and req.input.params.prompt_logprobs == 2 and req.input.params.logprobs == 2
    plain = parse_request(Endpoint.COMPLETIONS, {**body, "echo": False}, CARD, None)
    assert not plain.echo and plain.input.params.prompt_logprobs is None
    no_lp = parse_request(
        Endpoint.COMPLETIONS, {"model": "m", "prompt": "hi", "echo": True}, CARD, None
    )
    assert no_lp.echo and no_lp.input.params.prompt_logprobs is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"echo": True, "messages": [{"role": "user", "content": "hi"}]},
            "only supported on /v1/completions",
        ),
        ({"echo": 1, "messages": [{"role": "user", "content": "hi"}]}, "echo must be a boolean"),
    ],
)
def test_echo_on_chat_is_refused(body: dict, message: str) -> None:
    with pytest.raises(FieldError, match=message) as err:
        parse_request(Endpoint.CHAT, {"model": "m", **body}, CARD, None)
    assert err.value.field == "echo"


def test_prompt_logprobs_are_bounded() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 20"):
        SamplingParams(prompt_logprobs=21)
    msg = ClientSamplingParams(prompt_logprobs=21).to_proto()
    with pytest.raises(ValueError, match=r"^sampling_params\.prompt_logprobs must be <= 20"):
        convert.sampling_params_from_proto(msg)


def test_the_prompt_logprobs_travel_with_the_first_token() -> None:
    first = FirstToken(7, None, 0, "s-1", prompt_logprobs=(LP, LP))
    assert prefill_event_from_proto(prefill_event_to_proto("r", first)) == first
    out = RequestOutput("r", [7], num_prompt_tokens=3, prompt_logprobs=[LP, LP])
    wire = convert.first_token_from_output(out)
    assert convert.output_from_first_token("r", wire, num_prompt_tokens=3) == out
    resp = convert.decode_response_from_output(out, completion_tokens=1)
    assert convert.output_from_decode_response("r", resp).prompt_logprobs == [LP, LP]


def test_a_moved_request_does_not_ask_for_them_again() -> None:
    progress = StreamProgress((1, 2, 3), SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert progress.resume()[1].prompt_logprobs == 1  # nothing emitted: the same request
    progress.record(RequestOutput("r", [9]))
    assert progress.resume()[1].prompt_logprobs is None


async def test_echo_over_http_and_prompt_logprobs_over_grpc(served_smollm2: ServedModel) -> None:
    prompt, output = "The quick brown fox", ids_of(served_smollm2, " jumps over")
    prompt_ids = ids_of(served_smollm2, prompt)
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=output)
    texts = [served_smollm2.tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        whole = await gw.client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=len(output)
        )
        stream = await gw.client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, stream=True
        )
        chunks = [c async for c in stream]
        bare = await gw.client.completions.create(model=MODEL, prompt=prompt_ids, echo=True)
        status, _, body = await post(
            gw.port,
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "echo": True},
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.server.port}") as channel:
            request = generate_pb2.GenerateRequest(
                text=prompt, sampling_params=ClientSamplingParams(prompt_logprobs=0).to_proto()
            )
            replies = [r async for r in generate_pb2_grpc.BatonStub(channel).Generate(request)]
    assert decode.requests[0].sampling_params.prompt_logprobs == 1
    choice = whole.choices[0]
    assert choice.text == prompt + " jumps over"
    lps = choice.logprobs
    n = len(prompt_ids)
    assert lps.tokens[:n] == texts
    assert lps.token_logprobs[:n] == [None, *(-(j + 1) / 8 for j in range(n - 1))]
    assert lps.top_logprobs[0] is None and lps.token_logprobs[n:] == [-0.5] * len(output)
    assert lps.text_offset[:2] == [0, len(texts[0])]
    assert lps.text_offset[n] == sum(len(t) for t in texts)
    assert whole.usage.prompt_tokens == n
    # Streamed: the prompt leads the first chunk.
    assert chunks[0].choices[0].text.startswith(prompt)
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lps.tokens
    # Token ids in, without logprobs: the prompt decoded, no logprobs asked of decode.
    assert bare.choices[0].text.startswith(prompt) and bare.choices[0].logprobs is None
    assert not decode.requests[2].sampling_params.HasField("prompt_logprobs")
    assert status == 400 and body["error"]["param"] == "echo"
    assert [lp.token_id for lp in replies[0].prompt_logprobs] == prompt_ids[1:]
    assert all(not r.prompt_logprobs for r in replies[1:])


async def test_echo_with_max_tokens_zero_returns_the_prompt_alone(
    served_smollm2: ServedModel,
) -> None:
    """Log-likelihood requests: the prompt and its logprobs, no generated token anywhere in
    the response (the one token generated downstream is kept from the client)."""
    prompt = "The quick brown fox"
    prompt_ids = ids_of(served_smollm2, prompt)
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(served_smollm2, " jumps"))
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        ask = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0}
        whole = await gw.client.completions.create(**ask)
        chunks = [c async for c in await gw.client.completions.create(**ask, stream=True)]
        status, _, body = await post(gw.port, "/v1/completions", {**ask, "echo": False})
    assert decode.requests[0].sampling_params.max_tokens == 1
    (choice,) = whole.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    n = len(prompt_ids)
    assert len(choice.logprobs.tokens) == n and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == [-(j + 1) / 8 for j in range(n - 1)]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n, 0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == choice.logprobs.tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    # Without echo, max_tokens 0 stays refused (as vLLM).
    assert status == 400 and body["error"]["param"] == "max_tokens"
