"""The OpenAI-compatible HTTP API over the wire: a real gateway (gRPC and HTTP on port 0)
in front of fake workers, driven by the official ``openai`` client and by raw HTTP.

Response shapes, the parameters that reach decode, worker failures as HTTP statuses
(before the first token) and error events (after it), deadlines, client disconnects
cancelling decode, readiness, draining and the HTTP flags. The OpenAI field mapping
itself is unit-tested in test_openai_request.py; the real model end to end in
test_e2e_openai.py.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from engine import errors
from gateway.config import GatewayConfig
from gateway.served_model import ServedModel
from protos.baton.v1 import common_pb2
from tests.fake_workers import FakeDecodeWorker, Script, eventually, fake_workers
from tests.http_helpers import MODEL, ids_of, post, raw_request, running_http

# --- responses -------------------------------------------------------------------------


async def test_completion_text_usage_and_request_id(served_smollm2: ServedModel) -> None:
    output = ids_of(served_smollm2, " Bonjour, 世界! 🎉 done")
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=output, chunk=2, cached_tokens=3)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        raw = await gw.client.completions.with_raw_response.create(
            model=MODEL, prompt="Say hi", max_tokens=20, extra_headers={"X-Request-Id": "r-1"}
        )
        got = raw.parse()
    assert raw.headers["x-request-id"] == "r-1"
    assert got.id == "cmpl-r-1" and got.object == "text_completion" and got.model == MODEL
    (choice,) = got.choices
    assert choice.text == served_smollm2.tokenizer.decode(output, skip_special_tokens=True)
    assert choice.finish_reason == "stop" and choice.logprobs is None
    prompt = await served_smollm2.tokenizer.encode("Say hi")
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == len(output)
    assert got.usage.total_tokens == len(prompt) + len(output)
    assert got.usage.prompt_tokens_details.cached_tokens == 3
    (sent,) = decode.requests
    assert list(sent.prompt_token_ids) == prompt and sent.request_id == "r-1"


async def test_chat_stream_chunks_and_usage(served_smollm2: ServedModel) -> None:
    output = ids_of(served_smollm2, "Four, of course.")
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=output, chunk=1, finish_reason=common_pb2.FINISH_REASON_LENGTH)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        stream = await gw.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is 2+2?"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    prompt = served_smollm2.tokenizer.decode(
        decode.requests[0].prompt_token_ids, skip_special_tokens=False
    )
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Four, of course."
    *body, last, usage = chunks
    assert [c.choices[0].finish_reason for c in body] == [None] * len(body)
    assert last.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert usage.choices == [] and usage.usage.completion_tokens == len(output)
    # The role chunk, then one per token; the last token comes with the finish reason.
    assert len(body) == len(output)


WORKER_PHASES = common_pb2.RequestTimings(
    reserved_s=0.001, queued_s=0.002, prefill_s=0.003, transfer_s=0.004
)
GATEWAY_PHASES = ("first_token_s", "decode_s", "total_s")


def assert_timings(timings: dict[str, float]) -> None:
    assert {k: timings[k] for k in ("reserved_s", "queued_s", "prefill_s", "transfer_s")} == {
        "reserved_s": 0.001,
        "queued_s": 0.002,
        "prefill_s": 0.003,
        "transfer_s": 0.004,
    }
    assert set(timings) == {*GATEWAY_PHASES, "reserved_s", "queued_s", "prefill_s", "transfer_s"}
    assert timings["first_token_s"] + timings["decode_s"] == pytest.approx(timings["total_s"])


async def test_baton_timings_on_the_response_and_on_the_last_chunk(
    served_smollm2: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=(10, 11, 12, 13), timings=WORKER_PHASES, delay_s=0.01)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        whole = await gw.client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert_timings((whole.model_extra or {})["baton_timings"])
        assert whole.model_extra["baton_timings"]["decode_s"] >= 0.02
        for include_usage in (False, True):
            stream = await gw.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": include_usage},
            )
            chunks = [c async for c in stream]
            carrying = [i for i, c in enumerate(chunks) if "baton_timings" in (c.model_extra or {})]
            assert carrying == [len(chunks) - 1], include_usage
            last = chunks[-1]
            assert (last.usage is not None) == include_usage
            assert bool(last.choices) != include_usage  # the usage chunk has no choices
            assert_timings(last.model_extra["baton_timings"])


async def test_sampling_parameters_reach_decode(served_smollm2: ServedModel) -> None:
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        await gw.client.completions.create(
            model=MODEL,
            prompt=[1, 2, 3],
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            seed=11,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logprobs=2,
            extra_body={
                "top_k": 5,
                "min_p": 0.1,
                "repetition_penalty": 1.2,
                "min_tokens": 2,
                "ignore_eos": True,
                "stop_token_ids": [9],
            },
        )
        await gw.client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "hi"},
            ],
            max_completion_tokens=4,
            logprobs=True,
            top_logprobs=3,
        )
    first, second = (r.sampling_params for r in decode.requests)
    assert list(decode.requests[0].prompt_token_ids) == [1, 2, 3]
    assert (first.max_tokens, first.temperature, first.seed, first.logprobs) == (7, 0.5, 11, 2)
    assert first.top_p == pytest.approx(0.9) and first.min_p == pytest.approx(0.1)
    assert (first.presence_penalty, first.frequency_penalty) == (0.5, -0.5)
    assert first.repetition_penalty == pytest.approx(1.2)
    assert (first.top_k, first.min_tokens, first.ignore_eos) == (5, 2, True)
    assert list(first.stop_token_ids) == [9]
    assert (second.max_tokens, second.logprobs) == (4, 3)
    rendered = served_smollm2.tokenizer.decode(
        decode.requests[1].prompt_token_ids, skip_special_tokens=False
    )
    assert "<|im_start|>system\nBe brief.<|im_end|>" in rendered


async def test_logprobs_in_each_endpoints_shape(served_smollm2: ServedModel) -> None:
    output = ids_of(served_smollm2, "hello world")
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=output)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        completion = await gw.client.completions.create(model=MODEL, prompt="x", logprobs=1)
        chat = await gw.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True
        )
        stream = await gw.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, stream=True
        )
        streamed = [
            lp
            for c in [c async for c in stream]
            if c.choices[0].logprobs
            for lp in c.choices[0].logprobs.content
        ]
    tokens = [served_smollm2.tokenizer.decode([t], skip_special_tokens=False) for t in output]
    lps = completion.choices[0].logprobs
    assert lps.tokens == tokens and lps.token_logprobs == [-0.5] * len(output)
    assert lps.text_offset == [0, len(tokens[0])]
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == tokens and [c.logprob for c in content] == [-0.5] * 2
    assert content[1].bytes == list(tokens[1].encode())
    assert [c.token for c in streamed] == tokens


async def test_stop_string_cuts_the_text_and_cancels_decode(served_smollm2: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(
        token_ids=ids_of(served_smollm2, "The answer is 42. END and more"), hang=True
    )
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        got = await gw.client.completions.create(
            model=MODEL, prompt="q", stop="END", extra_headers={"X-Request-Id": "r-stop"}
        )
        await eventually(lambda: decode.cancelled == ["r-stop"])
    assert got.choices[0].text == "The answer is 42. "
    assert got.choices[0].finish_reason == "stop"


async def test_models_and_health(served_smollm2: ServedModel) -> None:
    async with fake_workers([FakeDecodeWorker()]) as (d, _), running_http(served_smollm2, d) as gw:
        models = await gw.client.models.list()
        status, _, body = await asyncio.to_thread(raw_request, gw.port, "GET", "/health")
    assert [m.id for m in models.data] == [MODEL]
    assert status == 200 and json.loads(body) == {"status": "serving"}


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (errors.ResourceExhaustedError("no free KV blocks"), 429, "no_capacity"),
        (errors.UnavailableError("decode is draining"), 503, "unavailable"),
        (errors.DeadlineExceededError("reserve wait"), 504, "deadline_exceeded"),
        (errors.AbortedError("bad checksum"), 503, "aborted"),
        (ValueError("prompt needs 9 blocks; the pool has 8"), 400, None),
    ],
)
async def test_worker_failure_before_the_first_token_is_an_http_status(
    served_smollm2: ServedModel, error: Exception, status: int, code: str | None
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(error=error)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as info:
                await gw.client.completions.create(model=MODEL, prompt="hi", stream=stream)
            assert info.value.status_code == status
            assert info.value.body["code"] == code, info.value.body
            assert str(error) in info.value.body["message"]


async def test_failure_after_the_first_token_ends_the_stream_with_an_error_event(
    served_smollm2: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(
        token_ids=[10, 11, 12], error=errors.UnavailableError("gone"), fail_after=2
    )
    async with (
        fake_workers([decode]) as (d, _),
        running_http(served_smollm2, d, max_migrations=0) as gw,
    ):
        stream = await gw.client.completions.create(model=MODEL, prompt="hi", stream=True)
        got = []
        with pytest.raises(openai.APIError, match="gone"):
            async for chunk in stream:
                got.append(chunk)
    assert len(got) == 2


async def test_a_stream_whose_decode_worker_dies_moves_on_over_http(
    served_smollm2: ServedModel,
) -> None:
    """The OpenAI path shares the request path: the stream goes on on the other decode
    worker, and the usage says the request moved."""

    def script(request) -> Script:  # noqa: ANN001
        if request.sampling_params.output_offset == 0:
            return Script(
                token_ids=[10, 11],
                error=errors.UnavailableError("gone"),
                fail_after=2,
                go_down=True,
                hang=True,
            )
        return Script(token_ids=[12, 13], finish_reason=common_pb2.FINISH_REASON_LENGTH)

    workers = [FakeDecodeWorker(), FakeDecodeWorker()]
    for w in workers:
        w.script_for = script
    async with fake_workers(workers) as (d, _), running_http(served_smollm2, d) as gw:
        stream = await gw.client.completions.create(
            model=MODEL,
            prompt="hi",
            stream=True,
            max_tokens=4,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None
    usage = chunks[-1].usage.model_dump()
    assert (usage["completion_tokens"], usage["baton_migrations"]) == (4, 1)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


async def test_deadline_header_is_a_504_and_travels_to_decode(served_smollm2: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=[], hang=True)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        status, _, body = await post(
            gw.port,
            "/v1/completions",
            {"model": MODEL, "prompt": "hi"},
            X_Request_Timeout="0.5",
            X_Request_Id="r-late",
        )
        await eventually(lambda: decode.cancelled == ["r-late"])
        bad, _, bad_body = await post(
            gw.port,
            "/v1/completions",
            {"model": MODEL, "prompt": "hi"},
            X_Request_Timeout="soon",
        )
    assert status == 504, body
    assert body["error"]["code"] == "deadline_exceeded"
    # <= 0.5 plus gRPC rounding the timeout up to its unit (microseconds over, seen on CI)
    assert 0 < decode.time_remaining["r-late"] <= 0.55
    assert bad == 400 and bad_body["error"]["param"] == "X-Request-Timeout"


async def test_default_request_timeout_applies_without_a_header(
    served_smollm2: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=[10], hang=True)
    async with (
        fake_workers([decode]) as (d, _),
        running_http(served_smollm2, d, request_timeout_s=0.5) as gw,
    ):
        stream = await gw.client.completions.create(model=MODEL, prompt="hi", stream=True)
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                pass
    assert info.value.body["code"] == "deadline_exceeded"


async def test_raw_http_errors(served_smollm2: ServedModel) -> None:
    async with fake_workers([FakeDecodeWorker()]) as (d, _), running_http(served_smollm2, d) as gw:
        huge = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
        too_large, _, body_413 = await post(gw.port, "/v1/completions", huge)
        not_json, _, body_400 = await post(gw.port, "/v1/completions", b"{not json")
        not_object, _, body_list = await post(gw.port, "/v1/completions", [1, 2])
        missing, _, body_404 = await asyncio.to_thread(raw_request, gw.port, "GET", "/v2/nothing")
        wrong, _, _ = await asyncio.to_thread(raw_request, gw.port, "GET", "/v1/completions")
    assert too_large == 413 and body_413["error"]["code"] == "request_too_large"
    assert not_json == 400 and "not valid JSON" in body_400["error"]["message"]
    assert not_object == 400 and "JSON object" in body_list["error"]["message"]
    assert missing == 404 and json.loads(body_404)["error"]["type"] == "invalid_request_error"
    assert wrong == 405


# --- cancellation, readiness, drain ------------------------------------------------------


async def test_disconnect_mid_stream_cancels_decode(served_smollm2: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(served_smollm2, "one two three"), hang=True)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        stream = await gw.client.completions.create(
            model=MODEL, prompt="hi", stream=True, extra_headers={"X-Request-Id": "r-gone"}
        )
        async for chunk in stream:
            assert chunk.choices[0].text
            break
        await stream.close()
        await eventually(lambda: decode.cancelled == ["r-gone"])
        assert gw.gateway.http is not None
        await eventually(lambda: gw.gateway.http.gate.in_flight == 0)


async def test_disconnect_before_the_first_token_cancels_decode(
    served_smollm2: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=[], hang=True)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        for stream in (False, True):
            rid = f"r-wait-{stream}"
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            body = json.dumps({"model": MODEL, "prompt": "hi", "stream": stream}).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            await eventually(lambda rid=rid: rid in decode.time_remaining)
            writer.close()
            await writer.wait_closed()
            await eventually(lambda rid=rid: rid in decode.cancelled)


async def test_not_ready_is_503_until_a_decode_worker_answers(served_smollm2: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.stats_error = errors.UnavailableError("still loading")
    async with (
        fake_workers([decode]) as (d, _),
        running_http(served_smollm2, d, wait_ready=False) as gw,
    ):
        status, _, body = await asyncio.to_thread(raw_request, gw.port, "GET", "/health")
        assert status == 503 and json.loads(body)["status"] == "the gateway is starting"
        # Started though: the probes that must not wait for the fleet pass.
        alive, _, body = await asyncio.to_thread(raw_request, gw.port, "GET", "/alive")
        assert alive == 200 and json.loads(body) == {"status": "alive"}
        with pytest.raises(openai.APIStatusError) as info:
            await gw.client.completions.create(model=MODEL, prompt="hi")
        assert info.value.status_code == 503
        decode.stats_error = None
        await gw.server.wait_ready()
        got = await gw.client.completions.create(model=MODEL, prompt="hi")
    assert got.choices[0].finish_reason == "stop"


async def test_stop_refuses_new_requests_and_drains_streams(served_smollm2: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(served_smollm2, "a b c d e f"), delay_s=0.1)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        stream = await gw.client.completions.create(model=MODEL, prompt="hi", stream=True)
        chunks = stream.__aiter__()
        text = (await anext(chunks)).choices[0].text
        stopping = asyncio.create_task(gw.server.stop())
        assert gw.gateway.http is not None
        await eventually(lambda: not gw.gateway.http.gate.open)
        health, _, body = await asyncio.to_thread(raw_request, gw.port, "GET", "/health")
        alive, _, _ = await asyncio.to_thread(raw_request, gw.port, "GET", "/alive")
        refused, _, _ = await post(gw.port, "/v1/completions", {"model": MODEL, "prompt": "x"})
        text += "".join([c.choices[0].text async for c in chunks])
        await stopping
    assert health == 503 and json.loads(body)["status"] == "the gateway is shutting down"
    assert alive == 503
    assert refused == 503
    assert text == "a b c d e f"  # the stream in flight finished inside the grace period


# --- configuration -----------------------------------------------------------------------


def test_http_flags_and_env_twins() -> None:
    assert GatewayConfig.from_args(["--decode", "d:1"], {}).http_port is None  # off
    config = GatewayConfig.from_args(
        ["--decode", "d:1", "--http-port", "0", "--otlp-endpoint", "http://otel:4317"],
        {"BATON_GATEWAY_HTTP_REQUEST_TIMEOUT_S": "30", "BATON_GATEWAY_HTTP_PORT_FILE": "/tmp/p"},
    )
    assert (config.http_port, config.http_request_timeout_s) == (0, 30.0)
    assert str(config.http_port_file) == "/tmp/p"
    assert config.otlp_endpoint == "http://otel:4317"
    assert (
        GatewayConfig.from_args(
            [], {"BATON_GATEWAY_DECODE": "d:1", "BATON_GATEWAY_HTTP_PORT": "8000"}
        ).http_port
        == 8000
    )


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--http-port", "65536"], "http_port"),
        (["--http-port", "http"], "--http-port"),
        (["--http-port", "9000", "--port", "9000"], "http_port and port"),
        (["--http-request-timeout-s", "-1"], "http_request_timeout_s"),
    ],
)
def test_bad_http_flags_name_the_setting(argv: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        GatewayConfig.from_args(["--decode", "d:1", *argv], {})


def test_baton_serve_passes_the_http_port_on() -> None:
    from gateway.cli import _parser, _spec

    args = _parser().parse_args(["serve", "--http-port", "8000"])
    assert _spec(args, args.gateway_port, args.http_port).http_port == 8000
    args = _parser().parse_args(["serve"])
    assert _spec(args, args.gateway_port, args.http_port).http_port is None


def test_the_finish_line_timings_read_back() -> None:
    from engine.request import RequestTimings
    from gateway.generation import describe_timings, parse_timings

    timings = RequestTimings(queued_s=0.004, prefill_s=1.25, first_token_s=1.3, decode_s=2.0)
    line = f"request r-1: finished (length) with 9 tokens in 3.300s; {describe_timings(timings)}"
    assert "reserved=- " in line and "transfer=- " in line
    assert parse_timings(line) == timings
    assert parse_timings("request r-2: failed") == RequestTimings()
