"""A request with n > 1 choices moves when its decode worker dies or drains mid-stream:
each unfinished choice continues alone on another worker from where its stream stopped
(its own prompt, seed + i and output offset), finished choices stay finished, and the
migration bound still rules. Two fake decode workers behind a real gateway.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from engine import errors
from engine.model_files import ModelFiles
from gateway.served_model import ServedModel, locate_model, read_model_card
from gateway.text.tokenizer import Tokenizer
from protos.baton.v1 import common_pb2, generate_pb2, worker_pb2
from rpc.errors import WorkerDrainingError
from tests.fake_workers import FakeDecodeWorker, Script, fake_workers
from tests.test_gateway_service import generate, generate_error, running_gateway

PROMPT = [7, 8, 9]
# Each choice's whole output, as an undisturbed run would give it; choice 1 ends early.
OUTPUT = [[100, 101, 102, 103, 104], [200], [300, 301, 302, 303, 304]]
# Messages sent before the first worker fails, the choices in turn: 100 200 300 101 301.
FAIL_AFTER = 5
SENT = {0: 2, 1: 1, 2: 2}  # tokens of each choice the client has then


@pytest.fixture(scope="module")
def model(smollm2: ModelFiles) -> Iterator[ServedModel]:
    source = locate_model("smollm2-135m")
    tokenizer = Tokenizer.load(source.directory)
    yield ServedModel.from_loaded(source, tokenizer, read_model_card(source, tokenizer))
    tokenizer.close()


def _request(**params: object) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id="many",
        token_ids=generate_pb2.TokenIds(ids=PROMPT),
        sampling_params=common_pb2.SamplingParameters(
            n=3, max_tokens=5, temperature=1.0, seed=7, **params
        ),  # type: ignore[arg-type]
    )


def _fleet(error: BaseException, *, again: bool = False) -> list[FakeDecodeWorker]:
    """The first worker to get the n = 3 request fails after FAIL_AFTER messages and goes
    down; a continued choice gets the rest of its output (or, ``again``, fails too)."""

    def script(request: worker_pb2.DecodeRequest) -> Script:
        if request.sampling_params.n == 3:
            return Script(choice_token_ids=OUTPUT, error=error, fail_after=FAIL_AFTER, go_down=True)
        index = int(request.request_id.rsplit("/", 1)[1])
        done = request.sampling_params.output_offset
        if again:
            return Script(token_ids=OUTPUT[index][done:], error=error, fail_after=1, hang=True)
        return Script(token_ids=OUTPUT[index][done:], finish_reason=common_pb2.FINISH_REASON_LENGTH)

    workers = [FakeDecodeWorker() for _ in range(2)]
    for w in workers:
        w.script_for = script
    return workers


@pytest.mark.parametrize(
    "error",
    [
        errors.UnavailableError("decode worker went away"),
        WorkerDrainingError("decode worker is draining"),
    ],
)
async def test_every_unfinished_choice_continues_where_it_stopped(
    model: ServedModel, error: BaseException
) -> None:
    workers = _fleet(error)
    async with fake_workers(workers) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, _request())
    streams: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished: dict[int, int] = {}
    for r in got:
        assert r.index not in finished, "nothing of a choice after its finish"
        streams[r.index] += r.token_ids
        if r.finish_reason:
            finished[r.index] = r.finish_reason
    assert streams == dict(enumerate(OUTPUT))  # no gap, no duplicate, per choice
    assert finished[1] == common_pb2.FINISH_REASON_STOP  # finished before the move
    assert finished[0] == finished[2] == common_pb2.FINISH_REASON_LENGTH  # after it
    moved = {r.request_id: r for w in workers for r in w.requests if r.sampling_params.n <= 1}
    assert sorted(moved) == ["many/0", "many/2"]  # the finished choice did not move
    for i in (0, 2):
        sent = moved[f"many/{i}"]
        done = SENT[i]
        assert list(sent.prompt_token_ids) == PROMPT + OUTPUT[i][:done]
        p = sent.sampling_params
        assert (p.seed, p.output_offset, p.max_tokens) == (7 + i, done, 5 - done)
        assert not p.HasField("prompt_logprobs")
    (first,) = [r for w in workers for r in w.requests if r.sampling_params.n == 3]
    failed = next(w for w in workers if first in w.requests)
    assert all(r.sampling_params.n == 3 for r in failed.requests)  # moved elsewhere
    usage = got[-1].usage
    assert usage.prompt_tokens == len(PROMPT)
    assert usage.completion_tokens == sum(len(o) for o in OUTPUT)
    assert usage.migrations == 1


async def test_choices_move_within_the_bound(model: ServedModel) -> None:
    error = errors.UnavailableError("decode worker went away")
    async with (
        fake_workers(_fleet(error)) as (d, _),
        running_gateway(model, d, max_migrations=0) as gw,
    ):
        got, err = await generate_error(gw.stub, _request())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot move" in err.details() and "--max-migrations 0" in err.details()
    assert sum(len(r.token_ids) for r in got) == FAIL_AFTER

    workers = _fleet(error, again=True)  # every continuation fails too: one move, then out
    async with fake_workers(workers) as (d, _), running_gateway(model, d, max_migrations=1) as gw:
        got, err = await generate_error(gw.stub, _request())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "already moved 1 time(s)" in err.details()


async def test_continued_choices_keep_the_clients_deadline(model: ServedModel) -> None:
    error = errors.UnavailableError("decode worker went away")
    workers = _fleet(error)
    for w in workers:
        first = w.script_for
        assert first is not None

        def hang_after_one(request: worker_pb2.DecodeRequest, first=first) -> Script:  # noqa: ANN001
            script = first(request)
            if request.sampling_params.n == 3:
                return script
            return Script(token_ids=script.token_ids[:1], hang=True)

        w.script_for = hang_after_one
    async with fake_workers(workers) as (d, _), running_gateway(model, d) as gw:
        got, err = await generate_error(gw.stub, _request(), timeout=1.5)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sum(len(r.token_ids) for r in got) == FAIL_AFTER + 2  # one more token per choice
    left = [
        w.time_remaining[f"many/{i}"]
        for w in workers
        for i in (0, 2)
        if f"many/{i}" in w.time_remaining
    ]
    # The client's 1.5 s, not a fresh budget; gRPC re-encodes a deadline relative to each
    # hop's receipt (rounded up), so a loaded host may read a few ms more than it.
    assert len(left) == 2 and all(t is not None and t < 1.6 for t in left)
