"""In-process fake decode and prefill workers for gateway tests.

A :class:`FakeDecodeWorker` plays a :class:`Script` per request (token chunks, delays, an
injected failure, or a hang until cancelled) and records what happened: the requests it
got, the deadline and metadata each arrived with, and which ones were cancelled. A
:class:`FakePrefillWorker` answers Stats, and a ``Prefill`` call only by refusing it (or by
ending it at once). With ``relay_prefill`` a fake decode worker first opens ``Prefill`` on
the request's prefill worker through the real ``GrpcPrefillLink``, so a refusal there
reaches the gateway the way a real decode worker relays it. Both run behind a real
``RpcServer`` on 127.0.0.1 port 0, so raised typed errors reach the gateway as real status
codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from decode_service.prefill_link import GrpcPrefillLink
from protos.baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from rpc.server import RpcServer, ServerSpec

DECODE_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


@dataclass(slots=True)
class Script:
    """What a fake decode worker does with one request."""

    token_ids: Sequence[int] = (10, 11, 12)
    chunk: int = 1  # tokens per DecodeResponse
    delay_s: float = 0.0  # before each message
    error: BaseException | None = None  # raised once `fail_after` messages were sent
    fail_after: int = 0
    go_down: bool = False  # with `error`: Stats fails from then on, as a dying worker's would
    hang: bool = False  # after the tokens: wait until cancelled instead of finishing
    finish_reason: int = common_pb2.FINISH_REASON_STOP
    cached_tokens: int = 0
    # Sent on the first message, as a decode worker reports its hand-off's phases.
    timings: common_pb2.RequestTimings | None = None
    # With SamplingParameters.n > 1: each choice's tokens (default: token_ids for each),
    # sent one token a message, the choices in turn, as decode's fan-out interleaves them.
    choice_token_ids: Sequence[Sequence[int]] | None = None


def worker_stats(role: int, **fields: int) -> worker_pb2.WorkerStats:
    defaults = {"total_kv_blocks": 100, "free_kv_blocks": 100}
    return worker_pb2.WorkerStats(role=role, incarnation_id="fake-1", **{**defaults, **fields})


class FakeDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """Plays ``script_for(request)`` (default: ``script``) and records every call."""

    def __init__(self, role: int = worker_pb2.WORKER_ROLE_DECODE) -> None:
        self.script = Script()
        self.script_for: Callable[[worker_pb2.DecodeRequest], Script] | None = None
        self.stats = worker_stats(role)
        self.stats_error: BaseException | None = None
        self.requests: list[worker_pb2.DecodeRequest] = []
        self.time_remaining: dict[str, float | None] = {}
        self.metadata: dict[str, dict[str, str]] = {}  # the invocation metadata of each call
        self.cancelled: list[str] = []
        self.completed: list[str] = []
        # Open Prefill on the request's prefill worker first, and fail as it fails.
        self.relay_prefill = False

    async def Stats(self, request, context):  # noqa: N802 (gRPC method name)
        if self.stats_error is not None:
            raise self.stats_error
        return self.stats

    async def Decode(self, request, context):  # noqa: N802
        rid = request.request_id
        self.requests.append(request)
        self.time_remaining[rid] = context.time_remaining()
        self.metadata[rid] = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        if self.relay_prefill and request.prefill_address:
            await self._relay_prefill(request.prefill_address, context.time_remaining())
        script = self.script_for(request) if self.script_for is not None else self.script
        want_logprobs = request.sampling_params.HasField("logprobs")
        chunks = [
            list(script.token_ids[i : i + script.chunk])
            for i in range(0, len(script.token_ids), script.chunk)
        ]
        try:
            if request.sampling_params.n > 1:
                for sent, msg in enumerate(self._choices(request, script, want_logprobs)):
                    self._maybe_fail(script, sent)  # after `fail_after` messages, all choices
                    yield msg
                self.completed.append(rid)
                return
            for sent, chunk in enumerate(chunks):
                self._maybe_fail(script, sent)
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                last = sent == len(chunks) - 1 and not script.hang
                yield self._response(request, script, chunk, want_logprobs, last, sent == 0)
            self._maybe_fail(script, len(chunks))
            if script.hang:
                await asyncio.Event().wait()
            if not chunks:
                yield self._response(request, script, [], want_logprobs, True, True)
            self.completed.append(rid)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise

    @classmethod
    def _choices(
        cls, request: worker_pb2.DecodeRequest, script: Script, want_logprobs: bool
    ) -> list[worker_pb2.DecodeResponse]:
        n = request.sampling_params.n
        tokens = script.choice_token_ids or [script.token_ids] * n
        out = []
        for step in range(max(len(t) for t in tokens)):
            for index in range(n):
                if step < len(tokens[index]):
                    last = step == len(tokens[index]) - 1
                    msg = cls._response(
                        request, script, [tokens[index][step]], want_logprobs, last, step == 0
                    )
                    msg.index = index
                    if last:
                        msg.usage.completion_tokens = len(tokens[index])
                    out.append(msg)
        return out

    @staticmethod
    async def _relay_prefill(address: str, timeout: float | None) -> None:
        """Open the Prefill stream as a decode worker does; its failure is raised as the
        decode worker's link raises it."""
        async with grpc.aio.insecure_channel(address) as channel:
            link = GrpcPrefillLink(channel, address, timeout)
            try:
                await link.receive()
            finally:
                link.cancel()

    def _maybe_fail(self, script: Script, sent: int) -> None:
        if script.error is not None and sent == script.fail_after:
            if script.go_down:
                self.stats_error = script.error
            raise script.error

    @staticmethod
    def _response(
        request: worker_pb2.DecodeRequest,
        script: Script,
        chunk: list[int],
        want_logprobs: bool,
        last: bool,
        first: bool,
    ) -> worker_pb2.DecodeResponse:
        msg = worker_pb2.DecodeResponse(token_ids=chunk)
        if first and script.timings is not None:
            msg.timings.CopyFrom(script.timings)
        if first and request.sampling_params.HasField("prompt_logprobs"):
            # Prompt token j + 1 gets -(j + 1) / 8: distinct, and exact in binary.
            msg.prompt_logprobs.extend(
                common_pb2.TokenLogprob(token_id=t, logprob=-(j + 1) / 8, rank=1)
                for j, t in enumerate(request.prompt_token_ids[1:])
            )
        if want_logprobs:
            msg.logprobs.extend(
                common_pb2.TokenLogprob(token_id=t, logprob=-0.5, rank=1) for t in chunk
            )
        if last:
            msg.finish_reason = script.finish_reason
            msg.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=len(script.token_ids),
                    cached_tokens=script.cached_tokens,
                )
            )
        return msg


class FakePrefillWorker(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers Stats (``stats``, or raises ``stats_error``); a Prefill call fails with
    ``prefill_error`` (a full queue: ResourceExhaustedError) or ends without a message."""

    def __init__(self, queued_prompt_tokens: int = 0) -> None:
        self.stats = worker_stats(
            worker_pb2.WORKER_ROLE_PREFILL, queued_prompt_tokens=queued_prompt_tokens
        )
        self.stats_error: BaseException | None = None
        self.prefill_error: BaseException | None = None
        self.prefill_calls = 0

    async def Stats(self, request, context):  # noqa: N802
        if self.stats_error is not None:
            raise self.stats_error
        return self.stats

    async def Prefill(self, request_iterator, context):  # noqa: N802
        self.prefill_calls += 1
        if self.prefill_error is not None:
            raise self.prefill_error


@dataclass(slots=True)
class FakeServer:
    """A started fake worker: its address and its servicer."""

    server: RpcServer
    servicer: FakeDecodeWorker | FakePrefillWorker
    address: str = field(init=False)

    def __post_init__(self) -> None:
        self.address = f"127.0.0.1:{self.server.port}"


async def start_fake(servicer: FakeDecodeWorker | FakePrefillWorker) -> FakeServer:
    """Serve ``servicer`` on 127.0.0.1 port 0; the caller stops ``.server``."""
    if isinstance(servicer, FakeDecodeWorker):

        def register(server: grpc.aio.Server) -> None:
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)

        name, service = "fake-decode", DECODE_SERVICE
    else:

        def register(server: grpc.aio.Server) -> None:
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)

        name, service = "fake-prefill", PREFILL_SERVICE
    server = RpcServer(
        ServerSpec(name=name, register=register, service_names=(service,), grace_s=0)
    )
    await server.start()
    await server.wait_ready()
    return FakeServer(server=server, servicer=servicer)


@contextlib.asynccontextmanager
async def fake_workers(
    decode: Sequence[FakeDecodeWorker], prefill: Sequence[FakePrefillWorker] = ()
) -> AsyncIterator[tuple[list[FakeServer], list[FakeServer]]]:
    """Run the given fakes; stops every one of them on the way out."""
    started: list[FakeServer] = []
    try:
        for servicer in (*decode, *prefill):
            started.append(await start_fake(servicer))
        yield started[: len(decode)], started[len(decode) :]
    finally:
        for fake in started:
            await fake.server.stop()


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0) -> None:
    """Wait until ``check()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
