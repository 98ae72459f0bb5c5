"""The gateway moves a stream whose decode worker dies or drains after the first token.

Two fake decode workers behind a real gateway: the first attempt of a request fails
mid-stream; the gateway opens ``Decode`` on the other worker with the prompt plus the
tokens already streamed and what is left of the budget, and the client's stream goes on
with no gap, no duplicate and no error. Failures that are not a worker leaving, and the
bound on moves, end the request with a status that names the cause.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from engine import errors
from engine.model_files import ModelFiles
from gateway.served_model import ServedModel, locate_model, read_model_card
from gateway.text.tokenizer import Tokenizer
from protos.baton.v1 import common_pb2, generate_pb2, worker_pb2
from rpc.errors import WorkerDrainingError
from tests.fake_workers import FakeDecodeWorker, Script, eventually, fake_workers
from tests.test_gateway_service import generate, generate_error, running_gateway
from tests.test_gateway_tracing import in_memory

PROMPT = [7, 8, 9]
FIRST = [100, 101, 102]  # what the first worker sends before it fails
REST = [103, 104, 105, 106]  # what the worker the request moves to sends


@pytest.fixture(scope="module")
def model(smollm2: ModelFiles) -> Iterator[ServedModel]:
    source = locate_model("smollm2-135m")
    tokenizer = Tokenizer.load(source.directory)
    yield ServedModel.from_loaded(source, tokenizer, read_model_card(source, tokenizer))
    tokenizer.close()


def _request(**params: object) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id="moving",
        token_ids=generate_pb2.TokenIds(ids=PROMPT),
        sampling_params=common_pb2.SamplingParameters(**params),  # type: ignore[arg-type]
    )


def _fleet(
    error: BaseException, *, every_attempt_fails: bool = False, count: int = 2
) -> list[FakeDecodeWorker]:
    """``count`` fake decode workers: an original attempt (output_offset 0) sends FIRST and
    fails with ``error``, the worker going down; a moved one sends REST and finishes
    (or fails again, with ``every_attempt_fails``)."""

    def script(request: worker_pb2.DecodeRequest) -> Script:
        if request.sampling_params.output_offset == 0:
            return Script(
                token_ids=FIRST, error=error, fail_after=len(FIRST), go_down=True, hang=True
            )
        if every_attempt_fails:
            return Script(token_ids=REST[:1], error=error, fail_after=1, hang=True)
        return Script(token_ids=REST)

    workers = [FakeDecodeWorker() for _ in range(count)]
    for w in workers:
        w.script_for = script
    return workers


def _moved(workers: list[FakeDecodeWorker]) -> list[worker_pb2.DecodeRequest]:
    return [r for w in workers for r in w.requests if r.sampling_params.output_offset]


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (errors.UnavailableError("decode worker went away"), "worker_gone"),
        (WorkerDrainingError("decode worker is draining"), "draining"),
    ],
    ids=["unavailable", "draining"],
)
async def test_a_stream_moves_on_and_the_client_sees_no_seam(
    model: ServedModel, error: Exception, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    workers = _fleet(error)
    registry = CollectorRegistry()
    provider, spans = in_memory()
    caplog.set_level(logging.INFO, logger="gateway")
    async with (
        fake_workers(workers) as (d, _),
        running_gateway(model, d, registry=registry, tracer_provider=provider) as gw,
    ):
        got = await generate(
            gw.stub, _request(max_tokens=20, min_tokens=5, seed=11, temperature=0.7, logprobs=1)
        )
        await eventually(lambda: sum(len(w.completed) for w in workers) == 1)
    tokens = [t for r in got for t in r.token_ids]
    assert tokens == FIRST + REST  # no gap, no duplicate
    assert [len(r.logprobs) for r in got] == [len(r.token_ids) for r in got]
    last = got[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 7)
    assert last.usage.migrations == 1
    (moved,) = _moved(workers)
    assert list(moved.prompt_token_ids) == PROMPT + FIRST
    sp = moved.sampling_params
    assert (sp.max_tokens, sp.min_tokens, sp.output_offset) == (17, 2, 3)
    assert (sp.seed, sp.logprobs) == (11, 1)
    assert sp.temperature == pytest.approx(0.7)
    # It went to the other worker, not back to the one that failed.
    original = next(
        w for w in workers if any(not r.sampling_params.output_offset for r in w.requests)
    )
    assert moved not in original.requests
    assert registry.get_sample_value("baton_request_migrations_total", {"reason": reason}) == 1
    # The move is an event on the next attempt's routing span, in the request's trace.
    routes = [sp for sp in spans.get_finished_spans() if sp.name == "gateway.route"]
    assert len(routes) == 2 and len({sp.context.trace_id for sp in routes}) == 1
    (event,) = [e for sp in routes for e in sp.events if e.name == "baton.migration"]
    assert event.attributes is not None
    assert event.attributes["baton.migration.reason"] == reason
    assert event.attributes["baton.migration.emitted_tokens"] == 3
    assert event.attributes["baton.migration.from"] != event.attributes["baton.migration.to"]
    lines = [r.getMessage() for r in caplog.records if "moved from decode" in r.getMessage()]
    assert len(lines) == 1 and f"after 3 token(s) ({reason}, move 1/3)" in lines[0], lines


async def test_a_stream_that_ends_without_a_finish_reason_moves(model: ServedModel) -> None:
    workers = [FakeDecodeWorker(), FakeDecodeWorker()]

    def script(request: worker_pb2.DecodeRequest) -> Script:
        if request.sampling_params.output_offset == 0:
            # Ends the call cleanly but never says the request finished.
            return Script(token_ids=FIRST, finish_reason=common_pb2.FINISH_REASON_UNSPECIFIED)
        return Script(token_ids=REST)

    for w in workers:
        w.script_for = script
    async with fake_workers(workers) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, _request(max_tokens=20))
    assert [t for r in got for t in r.token_ids] == FIRST + REST
    assert got[-1].usage.migrations == 1


async def test_the_bound_on_moves_ends_the_request_naming_it(model: ServedModel) -> None:
    workers = _fleet(
        errors.UnavailableError("decode worker went away"), every_attempt_fails=True, count=3
    )
    async with (
        fake_workers(workers) as (d, _),
        running_gateway(model, d, max_migrations=2) as gw,
    ):
        got, err = await generate_error(gw.stub, _request(max_tokens=20))
    tokens = [t for r in got for t in r.token_ids]
    assert tokens == FIRST + REST[:1] + REST[:1]  # each move resumed after what was sent
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert "already moved 2 time(s), the most --max-migrations (2) allows" in err.details()
    offsets = sorted(r.sampling_params.output_offset for r in _moved(workers))
    assert offsets == [3, 4]


async def test_a_failure_that_is_not_a_worker_leaving_does_not_move(model: ServedModel) -> None:
    workers = _fleet(errors.InternalError("kernel fault"))
    async with fake_workers(workers) as (d, _), running_gateway(model, d) as gw:
        got, err = await generate_error(gw.stub, _request(max_tokens=20))
    assert [t for r in got for t in r.token_ids] == FIRST
    assert err.code() is grpc.StatusCode.INTERNAL
    assert not _moved(workers)


async def test_a_client_cannot_set_the_internal_offset(model: ServedModel) -> None:
    workers = _fleet(errors.UnavailableError("x"))
    async with fake_workers(workers) as (d, _), running_gateway(model, d) as gw:
        _, err = await generate_error(gw.stub, _request(max_tokens=20, output_offset=2))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.output_offset" in err.details()
    assert not any(w.requests for w in workers)


async def test_a_move_never_goes_back_to_the_worker_it_left(model: ServedModel) -> None:
    """With the only other decode worker failing too, the request does not burn its moves
    on the workers it already left (a dead one looks up until its polls go silent): it
    ends UNAVAILABLE saying no other worker is up."""
    workers = _fleet(errors.UnavailableError("decode worker went away"), every_attempt_fails=True)
    async with fake_workers(workers) as (d, _), running_gateway(model, d) as gw:
        _, err = await generate_error(gw.stub, _request(max_tokens=20))
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    assert "but the one(s) this request already failed on" in err.details()
    assert len(_moved(workers)) == 1  # one move, to the other worker; none back
