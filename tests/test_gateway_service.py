"""The gateway over the wire: a real gateway server on port 0 in front of fake workers.

Streaming, edge validation, stop strings, cancellation and deadlines travelling
downstream, retries before the first token, failures after it, routing and readiness.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import errors
from engine.model_files import ModelFiles
from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.served_model import ServedModel, locate_model, read_model_card
from gateway.text.tokenizer import Tokenizer
from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc, worker_pb2
from rpc.server import RpcServer
from tests.fake_workers import (
    FakeDecodeWorker,
    FakePrefillWorker,
    FakeServer,
    Script,
    eventually,
    fake_workers,
)
from tests.test_gateway_validation import BAD_IDS, BAD_REQUESTS

TIMEOUT = 10.0


@pytest.fixture(scope="module")
def model(smollm2: ModelFiles) -> Iterator[ServedModel]:
    source = locate_model("smollm2-135m")
    assert source.directory == smollm2.path and not source.is_gguf
    tokenizer = Tokenizer.load(source.directory)
    yield ServedModel.from_loaded(source, tokenizer, read_model_card(source, tokenizer))
    tokenizer.close()


@dataclass(slots=True)
class Running:
    server: RpcServer
    gateway: Gateway
    stub: generate_pb2_grpc.BatonStub
    channel: grpc.aio.Channel


@contextlib.asynccontextmanager
async def running_gateway(
    model: ServedModel,
    decode: Sequence[FakeServer],
    prefill: Sequence[FakeServer] = (),
    *,
    max_retries: int = 2,
    wait_ready: bool = True,
    worker_down_after_s: float = 0.5,
    wait_for_worker_s: float = 0.2,
    registry: CollectorRegistry | None = None,
    max_migrations: int = 3,
    tracer_provider: object = None,
    local_prefill_tokens: int = 0,
) -> AsyncIterator[Running]:
    config = GatewayConfig(
        decode=tuple(d.address for d in decode),
        prefill=tuple(p.address for p in prefill),
        port=0,
        max_retries=max_retries,
        max_migrations=max_migrations,
        # Every prompt to the prefill worker these tests route (conditional
        # disaggregation has its own tests).
        local_prefill_tokens=local_prefill_tokens,
        grace_s=1.0,
        stats_interval_s=0.05,
        stats_timeout_s=0.5,
        worker_down_after_s=worker_down_after_s,
        wait_for_worker_s=wait_for_worker_s,
    )
    gateway = Gateway(
        config,
        model=model,
        registry=registry,
        tracer_provider=tracer_provider,  # type: ignore[arg-type]
    )
    server = RpcServer(gateway.spec())
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        if wait_ready:
            await server.wait_ready()
            await eventually(lambda: all(w.up for w in gateway.router.workers))
        yield Running(server, gateway, generate_pb2_grpc.BatonStub(channel), channel)
    finally:
        await channel.close()
        await server.stop()
        await gateway.aclose()


async def generate(
    stub: generate_pb2_grpc.BatonStub, request: generate_pb2.GenerateRequest
) -> list[generate_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(request, timeout=TIMEOUT)]


async def generate_error(
    stub: generate_pb2_grpc.BatonStub,
    request: generate_pb2.GenerateRequest,
    timeout: float = TIMEOUT,
) -> tuple[list[generate_pb2.GenerateResponse], grpc.aio.AioRpcError]:
    got: list[generate_pb2.GenerateResponse] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in stub.Generate(request, timeout=timeout):
            got.append(response)
    return got, info.value


def text_request(text: str = "Hello", **fields: object) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text=text, **fields)


def ids_of(model: ServedModel, text: str) -> list[int]:
    return model.tokenizer._encode(text, False)


# --- streaming -----------------------------------------------------------------------


async def test_streams_text_tokens_and_usage(model: ServedModel) -> None:
    output = ids_of(model, " Bonjour, 世界! 🎉 done")
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=output, chunk=2, cached_tokens=3)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, text_request("Say hi", request_id="r-stream"))
    assert [t for r in got for t in r.token_ids] == output
    assert "".join(r.text for r in got) == model.tokenizer.decode(output, skip_special_tokens=True)
    assert all(r.request_id == "r-stream" for r in got)
    assert [r.finish_reason for r in got[:-1]] == [common_pb2.FINISH_REASON_UNSPECIFIED] * (
        len(got) - 1
    )
    last = got[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    prompt = await model.tokenizer.encode("Say hi")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(output))
    assert last.usage.cached_tokens == 3
    assert all(not r.HasField("usage") for r in got[:-1])
    (sent,) = decode.requests
    assert list(sent.prompt_token_ids) == prompt
    assert sent.prefill_address == ""  # single-process mode
    assert sent.request_id == "r-stream"


async def test_chat_is_rendered_by_the_template(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    messages = generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="user", content="What is 2+2?")]
    )
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, generate_pb2.GenerateRequest(chat=messages))
    prompt = model.tokenizer.decode(decode.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert got[-1].request_id and got[-1].request_id == decode.requests[0].request_id


async def test_logprobs_and_sampling_params_reach_decode(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    params = common_pb2.SamplingParameters(temperature=0, max_tokens=3, logprobs=2, seed=7)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, text_request(sampling_params=params))
    for response in got:
        assert [lp.token_id for lp in response.logprobs] == list(response.token_ids)
    sent = decode.requests[0].sampling_params
    assert (sent.temperature, sent.max_tokens, sent.logprobs, sent.seed) == (0, 3, 2, 7)


async def test_model_info(model: ServedModel) -> None:
    async with fake_workers([FakeDecodeWorker()]) as (d, _), running_gateway(model, d) as gw:
        info = await gw.stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=TIMEOUT)
    assert info.model_id == "smollm2-135m"
    assert (info.vocab_size, info.max_model_len) == (49152, 8192)
    assert list(info.eos_token_ids) == [2]
    assert info.has_chat_template and info.max_logprobs == 20


# --- validation over the wire ----------------------------------------------------------


async def test_malformed_requests_are_invalid_argument_and_the_gateway_keeps_serving(
    model: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        for case_id, build, field in BAD_REQUESTS:
            _, err = await generate_error(gw.stub, build(model.card))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, case_id
            assert err.details().startswith(field), (case_id, err.details())
        assert len(BAD_IDS) == len(BAD_REQUESTS)
        got = await generate(gw.stub, text_request())
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert len(decode.requests) == 1  # no malformed request reached a worker


async def test_text_too_long_after_tokenization_is_invalid_argument(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        _, err = await generate_error(gw.stub, text_request(" hello" * 8192))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("text has 8192 tokens")
    assert decode.requests == []


# --- stop strings, cancellation, deadlines ---------------------------------------------


@pytest.mark.parametrize(("include", "expected"), [(False, "The answer is 42. "), (True, None)])
async def test_stop_string_ends_the_stream_and_cancels_decode(
    model: ServedModel, include: bool, expected: str | None
) -> None:
    output = ids_of(model, "The answer is 42. END of story, and much more text")
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=output, chunk=3, hang=True)
    request = text_request(request_id="r-stop", stop=["END"], include_stop_str_in_output=include)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, request)
        await eventually(lambda: decode.cancelled == ["r-stop"])
    text = "".join(r.text for r in got)
    assert text == (expected if expected is not None else "The answer is 42. END")
    last = got[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    returned = [t for r in got for t in r.token_ids]
    assert returned == output[: len(returned)]
    assert "END" in model.tokenizer.decode(returned, skip_special_tokens=True)
    assert "END" not in model.tokenizer.decode(returned[:-1], skip_special_tokens=True)
    assert last.usage.completion_tokens == len(returned)


async def test_client_cancel_cancels_decode(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(model, "one two three"), hang=True)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        call = gw.stub.Generate(text_request(request_id="r-cancel"), timeout=TIMEOUT)
        first = await call.read()
        assert first.token_ids
        call.cancel()
        await eventually(lambda: decode.cancelled == ["r-cancel"])
        await eventually(lambda: gw.server.in_flight == 0)


async def test_deadline_travels_to_decode(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=[10], hang=True)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        _, err = await generate_error(gw.stub, text_request(request_id="r-late"), timeout=1.0)
        assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: decode.cancelled == ["r-late"])
    remaining = decode.time_remaining["r-late"]
    # The wire rounds a deadline up to its timeout unit: allow a little over the 1 s.
    assert remaining is not None and 0 < remaining <= 1.1


# --- retries and failures ---------------------------------------------------------------


async def test_failure_before_first_token_retries_on_another_prefill(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    preferred, other = FakePrefillWorker(queued_prompt_tokens=0), FakePrefillWorker(500)
    async with (
        fake_workers([decode], [preferred, other]) as (d, p),
        running_gateway(model, d, p) as gw,
    ):
        bad = p[0].address
        decode.script_for = lambda r: (
            Script(error=errors.AbortedError("transfer checksum mismatch"))
            if r.prefill_address == bad
            else Script()
        )
        got = await generate(gw.stub, text_request())
    assert [r.prefill_address for r in decode.requests] == [p[0].address, p[1].address]
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert [t for r in got for t in r.token_ids] == [10, 11, 12]


async def test_failure_before_first_token_moves_off_a_decode_worker_that_is_down(
    model: ServedModel,
) -> None:
    dying, healthy = FakeDecodeWorker(), FakeDecodeWorker()
    healthy.stats = worker_pb2.WorkerStats(
        role=worker_pb2.WORKER_ROLE_DECODE, total_kv_blocks=100, free_kv_blocks=10
    )
    dying.script = Script(error=errors.UnavailableError("engine died"), go_down=True)
    async with fake_workers([dying, healthy]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, text_request())
        # Silent for longer than worker_down_after_s: out of rotation.
        await eventually(lambda: not gw.gateway.router.workers[0].up)
    assert (len(dying.requests), len(healthy.requests)) == (1, 1)
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_retries_are_bounded(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(error=errors.UnavailableError("no prefill reachable"))
    async with fake_workers([decode]) as (d, _), running_gateway(model, d, max_retries=1) as gw:
        _, err = await generate_error(gw.stub, text_request())
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert err.details() == "no prefill reachable"
    assert len(decode.requests) == 2


async def test_a_full_prefill_queue_is_retried_on_another_prefill_worker(
    model: ServedModel,
) -> None:
    """One decode worker: its prefill worker's full queue is no reason to give up on it."""
    decode = FakeDecodeWorker()
    decode.relay_prefill = True
    full, idle = FakePrefillWorker(queued_prompt_tokens=0), FakePrefillWorker(500)
    full.prefill_error = errors.ResourceExhaustedError("engine queue is full (2 waiting)")
    async with (
        fake_workers([decode], [full, idle]) as (d, p),
        running_gateway(model, d, p) as gw,
    ):
        got = await generate(gw.stub, text_request())
    assert [r.prefill_address for r in decode.requests] == [p[0].address, p[1].address]
    assert (full.prefill_calls, idle.prefill_calls) == (1, 1)
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert [t for r in got for t in r.token_ids] == [10, 11, 12]


async def test_when_every_prefill_queue_is_full_each_is_asked_once(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.relay_prefill = True
    prefill = [FakePrefillWorker(0), FakePrefillWorker(500)]
    for worker in prefill:
        worker.prefill_error = errors.ResourceExhaustedError("engine queue is full")
    async with (
        fake_workers([decode], prefill) as (d, p),
        running_gateway(model, d, p, max_retries=5) as gw,
    ):
        _, err = await generate_error(gw.stub, text_request())
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "engine queue is full" in err.details()
    assert [r.prefill_address for r in decode.requests] == [p[0].address, p[1].address]


async def test_abort_after_first_token_surfaces_without_retry(model: ServedModel) -> None:
    """A plain ABORTED (no drain marker) after the first token is not a worker leaving:
    the request ends with it (``test_gateway_migration`` has the failures that move)."""
    error = errors.AbortedError("KV epoch is stale")
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=[10, 11, 12], error=error, fail_after=2)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got, err = await generate_error(gw.stub, text_request())
    assert [t for r in got for t in r.token_ids] == [10, 11]
    assert err.code() is grpc.StatusCode.ABORTED
    assert err.details() == str(error)
    assert len(decode.requests) == 1


async def test_unavailable_after_first_token_with_moves_off_names_the_flag(
    model: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(
        token_ids=[10, 11, 12], error=errors.UnavailableError("decode went away"), fail_after=2
    )
    async with (
        fake_workers([decode]) as (d, _),
        running_gateway(model, d, max_migrations=0) as gw,
    ):
        got, err = await generate_error(gw.stub, text_request())
    assert [t for r in got for t in r.token_ids] == [10, 11]
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert "decode went away" in err.details()
    assert "moving requests is off (--max-migrations 0)" in err.details()
    assert len(decode.requests) == 1


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ValueError("prompt_token_ids: 9000 tokens exceed 8192"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ResourceExhaustedError("no free KV blocks"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.DeadlineExceededError("KV never arrived"), grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
    ids=["invalid-argument", "resource-exhausted", "deadline-exceeded"],
)
async def test_other_downstream_errors_pass_through(
    model: ServedModel, error: Exception, code: grpc.StatusCode
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(error=error)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        _, err = await generate_error(gw.stub, text_request())
    assert (err.code(), err.details()) == (code, str(error))
    assert len(decode.requests) == 1


# --- routing and readiness --------------------------------------------------------------


async def test_routes_to_most_free_decode_and_least_queued_prefill(model: ServedModel) -> None:
    crowded, roomy = FakeDecodeWorker(), FakeDecodeWorker()
    crowded.stats = worker_pb2.WorkerStats(free_kv_blocks=90, num_running=8)
    roomy.stats = worker_pb2.WorkerStats(free_kv_blocks=50, num_running=1)
    busy, idle = FakePrefillWorker(queued_prompt_tokens=4000), FakePrefillWorker(10)
    async with (
        fake_workers([crowded, roomy], [busy, idle]) as (d, p),
        running_gateway(model, d, p) as gw,
    ):
        await generate(gw.stub, text_request())
    assert crowded.requests == []
    assert [r.prefill_address for r in roomy.requests] == [p[1].address]


async def test_no_decode_worker_up_is_unavailable(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        await d[0].server.stop()
        await eventually(lambda: not gw.gateway.router.workers[0].up)
        _, err = await generate_error(gw.stub, text_request())
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert "no decode worker is up" in err.details()


async def test_no_prefill_worker_up_is_unavailable(model: ServedModel) -> None:
    decode, prefill = FakeDecodeWorker(), FakePrefillWorker()
    async with fake_workers([decode], [prefill]) as (d, p), running_gateway(model, d, p) as gw:
        prefill.stats_error = errors.UnavailableError("draining")
        await eventually(lambda: not gw.gateway.router.workers[1].up)
        _, err = await generate_error(gw.stub, text_request())
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert "no prefill worker is up" in err.details()
        prefill.stats_error = None
        await eventually(lambda: gw.gateway.router.workers[1].up)
        got = await generate(gw.stub, text_request())
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_serving_only_once_a_decode_worker_answers(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.stats_error = errors.UnavailableError("still loading weights")
    async with fake_workers([decode]) as (d, _), running_gateway(model, d, wait_ready=False) as gw:
        health = health_pb2_grpc.HealthStub(gw.channel)

        async def status() -> int:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            return reply.status

        assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
        _, err = await generate_error(gw.stub, text_request())
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        decode.stats_error = None
        await gw.server.wait_ready()
        assert await status() == health_pb2.HealthCheckResponse.SERVING
        got = await generate(gw.stub, text_request())
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP


# --- metrics ----------------------------------------------------------------------------


async def test_requests_latencies_and_workers_are_measured(model: ServedModel) -> None:
    registry = CollectorRegistry()
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=[10, 11, 12, 13], delay_s=0.01)
    async with (
        fake_workers([decode]) as (d, _),
        running_gateway(model, d, registry=registry, max_retries=0) as gw,
    ):
        await generate(gw.stub, text_request())
        decode.script = Script(error=errors.ResourceExhaustedError("no free KV blocks"))
        await generate_error(gw.stub, text_request())
        bad = common_pb2.SamplingParameters(max_tokens=0)
        await generate_error(gw.stub, text_request(sampling_params=bad))
        text = generate_latest(registry).decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert got[("baton_requests_total", (("status", "OK"),))] == 1
    assert got[("baton_requests_total", (("status", "RESOURCE_EXHAUSTED"),))] == 1
    assert got[("baton_requests_total", (("status", "INVALID_ARGUMENT"),))] == 1
    assert got[("baton_time_to_first_token_seconds_count", ())] == 1
    assert got[("baton_inter_token_latency_seconds_count", ())] == 3
    assert got[("baton_e2e_request_latency_seconds_count", ())] == 3
    assert got[("baton_streams_in_flight", ())] == 0
    assert got[("baton_workers_up", (("kind", "decode"),))] == 1
    assert got[("baton_workers_known", (("kind", "prefill"),))] == 0
