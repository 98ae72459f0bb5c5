"""rpc.server + rpc.errors over real loopback servers with toy worker servicers.

Also runnable as ``python -m tests.test_rpc_server --port-file F --release-file R``: the
toy server under ``rpc.server.serve``, for the SIGTERM drain test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine import errors
from protos.baton.v1 import common_pb2, kv_pb2, worker_pb2, worker_pb2_grpc
from rpc.server import ALIVE_SERVICE, RpcServer, ServerSpec, serve, write_port_file

REPO = Path(__file__).resolve().parent.parent
DECODE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
PREFILL = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
CALL_TIMEOUT = 10.0


class ToyDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Stats raises ``stats_error`` if set. Decode yields two tokens, then raises
    ``stream_errors[request_id]`` if set; a request id starting with "hold" then waits
    for ``release`` (or ``release_file``); then a last token with usage."""

    def __init__(self, release_file: Path | None = None) -> None:
        self.stats_error: BaseException | None = None
        self.stream_errors: dict[str, BaseException] = {}
        self.release = asyncio.Event()
        self.release_file = release_file
        self.unwound: list[str] = []

    async def Stats(self, request, context):  # noqa: N802 (gRPC method name)
        if self.stats_error is not None:
            raise self.stats_error
        return worker_pb2.WorkerStats(
            role=worker_pb2.WORKER_ROLE_DECODE, incarnation_id="toy", total_kv_blocks=8
        )

    async def Decode(self, request, context):  # noqa: N802
        rid = request.request_id
        try:
            for token in (10, 11):
                yield worker_pb2.DecodeResponse(token_ids=[token])
            if rid in self.stream_errors:
                raise self.stream_errors[rid]
            if rid.startswith("hold"):
                await self._released()
            yield worker_pb2.DecodeResponse(
                token_ids=[12],
                finish_reason=common_pb2.FINISH_REASON_STOP,
                usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids)),
            )
        finally:
            self.unwound.append(rid)

    async def _released(self) -> None:
        while not self.release.is_set():
            if self.release_file is not None and self.release_file.exists():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), 0.02)


class ToyPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Prefill: FirstToken, then ``errors[request_id]`` if set, else TransferComplete and
    a wait for the ack (a refused ack raises AbortedError)."""

    def __init__(self) -> None:
        self.errors: dict[str, BaseException] = {}

    async def Stats(self, request, context):  # noqa: N802
        return worker_pb2.WorkerStats(role=worker_pb2.WORKER_ROLE_PREFILL)

    async def Prefill(self, request_iterator, context):  # noqa: N802
        req = (await anext(request_iterator)).request
        yield worker_pb2.PrefillServerMessage(
            first_token=worker_pb2.FirstToken(token_id=len(req.prompt_token_ids))
        )
        if req.request_id in self.errors:
            raise self.errors[req.request_id]
        yield worker_pb2.PrefillServerMessage(
            transfer_complete=worker_pb2.TransferComplete(
                request_id=req.request_id, epoch=req.kv.block_epoch, num_bytes=64
            )
        )
        ack = (await anext(request_iterator)).ack
        if not ack.ok:
            raise errors.AbortedError(f"request {ack.request_id}: {ack.reason}")


def toy_spec(
    decode: ToyDecode,
    prefill: ToyPrefill,
    *,
    ready: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
    port_file: Path | None = None,
) -> ServerSpec:
    def register(server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, server)
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, server)

    return ServerSpec(
        name="toy",
        register=register,
        service_names=(DECODE, PREFILL),
        ready=ready,
        grace_s=grace_s,
        port_file=port_file,
    )


@contextlib.asynccontextmanager
async def running(
    *, ready: Callable[[], Awaitable[None]] | None = None, grace_s: float = 5.0
) -> AsyncIterator[tuple[RpcServer, grpc.aio.Channel, ToyDecode, ToyPrefill]]:
    decode, prefill = ToyDecode(), ToyPrefill()
    server = RpcServer(toy_spec(decode, prefill, ready=ready, grace_s=grace_s))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, channel, decode, prefill
    finally:
        await channel.close()
        await server.stop()


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
    return reply.status


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list:
    """The remaining messages of a stream already read with ``read()``."""
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def stats_error(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker_pb2_grpc.DecodeWorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=CALL_TIMEOUT
        )
    return info.value


TYPED = [
    (ValueError("top_p must be in (0, 1]"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.LayoutMismatchError("block_size: 16 != 32"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhaustedError("no free KV blocks"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnavailableError("prefill is gone"), grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError("no transfer in 5s"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.CancelledError("stop string"), grpc.StatusCode.CANCELLED),
    (errors.AbortedError("checksum mismatch"), grpc.StatusCode.ABORTED),
]
TYPED_IDS = [type(e).__name__ for e, _ in TYPED]


# --- lifecycle: readiness, health, reflection ----------------------------------------


async def test_health_goes_serving_only_after_ready() -> None:
    gate = asyncio.Event()

    async def ready() -> None:
        await gate.wait()

    async with running(ready=ready) as (server, channel, _, _):
        assert await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health_status(channel, DECODE) == health_pb2.HealthCheckResponse.NOT_SERVING
        # Started, not ready: what a startup or liveness probe that must not wait asks.
        assert await health_status(channel, ALIVE_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        err = await stats_error(channel)
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert "starting" in err.details()

        gate.set()
        await server.wait_ready()
        for service in ("", DECODE, PREFILL):
            assert await health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING
        stats = await worker_pb2_grpc.DecodeWorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=CALL_TIMEOUT
        )
        assert stats.incarnation_id == "toy"


async def test_a_fatal_fault_turns_health_not_serving_and_refuses_calls() -> None:
    """A worker whose engine died reports NOT_SERVING (a liveness probe restarts it) and
    refuses new calls with UNAVAILABLE naming the reason."""
    fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def wait_fatal() -> str:
        return await fatal

    decode, prefill = ToyDecode(), ToyPrefill()
    spec = dataclasses.replace(toy_spec(decode, prefill), fatal=wait_fatal)
    server = RpcServer(spec)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        await server.wait_ready()
        assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        fatal.set_result("engine thread died: MemoryError()")

        async def not_serving() -> bool:
            return (
                await health_status(channel, DECODE) == health_pb2.HealthCheckResponse.NOT_SERVING
            )

        await eventually(not_serving)
        assert await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        err = await stats_error(channel)
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert "engine thread died" in err.details()
    finally:
        await channel.close()
        await server.stop()


async def test_health_follows_liveness_both_ways() -> None:
    """A worker whose engine is stuck in a step reports NOT_SERVING and refuses new calls
    naming the reason; once it steps again it is SERVING and admits calls again."""
    reason: list[str | None] = [None]
    decode, prefill = ToyDecode(), ToyPrefill()
    spec = dataclasses.replace(
        toy_spec(decode, prefill), liveness=lambda: reason[0], liveness_interval_s=0.02
    )
    server = RpcServer(spec)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")

    async def status_is(want: int) -> bool:
        return all([await health_status(channel, s) == want for s in ("", DECODE, PREFILL)])

    try:
        await server.wait_ready()
        assert await status_is(health_pb2.HealthCheckResponse.SERVING)
        reason[0] = "the engine has not finished a step for 61.0 s"
        await eventually(lambda: status_is(health_pb2.HealthCheckResponse.NOT_SERVING))
        err = await stats_error(channel)
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert "has not finished a step" in err.details()
        reason[0] = None
        await eventually(lambda: status_is(health_pb2.HealthCheckResponse.SERVING))
        stats = await worker_pb2_grpc.DecodeWorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=CALL_TIMEOUT
        )
        assert stats.incarnation_id == "toy"
    finally:
        await channel.close()
        await server.stop()


async def test_liveness_never_revives_a_fatal_fault() -> None:
    fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def wait_fatal() -> str:
        return await fatal

    reason: list[str | None] = ["stuck in a step"]
    decode, prefill = ToyDecode(), ToyPrefill()
    spec = dataclasses.replace(
        toy_spec(decode, prefill),
        fatal=wait_fatal,
        liveness=lambda: reason[0],
        liveness_interval_s=0.02,
    )
    server = RpcServer(spec)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        await server.wait_ready()

        async def not_serving() -> bool:
            return await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING

        await eventually(not_serving)
        fatal.set_result("KV receiver thread died: MemoryError()")
        await asyncio.sleep(0.1)
        reason[0] = None  # the engine steps again, but the receiver stays dead
        await asyncio.sleep(0.2)
        assert await not_serving()
        err = await stats_error(channel)
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert "KV receiver thread died" in err.details()
    finally:
        await channel.close()
        await server.stop()


async def test_failed_readiness_stops_serve() -> None:
    async def ready() -> None:
        raise RuntimeError("weights not found")

    spec = toy_spec(ToyDecode(), ToyPrefill(), ready=ready)
    with pytest.raises(RuntimeError, match="weights not found"):
        await asyncio.wait_for(serve(spec), 20)


async def test_reflection_lists_every_service() -> None:
    async with running() as (_, channel, _, _):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(timeout=CALL_TIMEOUT)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        await call.done_writing()
        names = {s.name for s in reply.list_services_response.service}
    assert {DECODE, PREFILL, "grpc.health.v1.Health"} <= names


def test_write_port_file_is_whole(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "port"
    write_port_file(path, 43210)
    write_port_file(path, 43211)
    assert path.read_text() == "43211\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["port"]


def test_spec_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="port"):
        ServerSpec(name="x", register=lambda s: None, service_names=(DECODE,), port=70000)
    with pytest.raises(ValueError, match="service_names"):
        ServerSpec(name="x", register=lambda s: None, service_names=())


# --- errors over the wire ------------------------------------------------------------


@pytest.mark.parametrize(("exc", "code"), TYPED, ids=TYPED_IDS)
async def test_unary_typed_error_reaches_client(exc: Exception, code: grpc.StatusCode) -> None:
    async with running() as (server, channel, decode, _):
        await server.wait_ready()
        decode.stats_error = exc
        err = await stats_error(channel)
    assert err.code() is code
    assert err.details() == str(exc)


async def test_unexpected_error_is_internal_logged_and_survived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running() as (server, channel, decode, _):
        await server.wait_ready()
        decode.stats_error = KeyError("slot 7")
        with caplog.at_level(logging.ERROR, logger="rpc.errors"):
            err = await stats_error(channel)
        assert err.code() is grpc.StatusCode.INTERNAL
        assert "KeyError" in err.details()
        logged = [r for r in caplog.records if r.name == "rpc.errors"]
        assert logged and logged[0].exc_info is not None
        assert "Stats" in logged[0].getMessage()

        decode.stats_error = None
        stats = await worker_pb2_grpc.DecodeWorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=CALL_TIMEOUT
        )
        assert stats.total_kv_blocks == 8


@pytest.mark.parametrize(
    ("exc", "code"),
    [*TYPED, (ZeroDivisionError("oops"), grpc.StatusCode.INTERNAL)],
    ids=[*TYPED_IDS, "unexpected"],
)
async def test_server_stream_error_mid_stream(exc: Exception, code: grpc.StatusCode) -> None:
    async with running() as (server, channel, decode, _):
        await server.wait_ready()
        decode.stream_errors["r1"] = exc
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id="r1"), timeout=CALL_TIMEOUT
        )
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for msg in call:
                received.extend(msg.token_ids)
        assert received == [10, 11]
        assert info.value.code() is code
        assert str(exc) in info.value.details()
        assert decode.unwound == ["r1"]


async def test_bidi_stream_happy_path_and_errors() -> None:
    async with running() as (server, channel, _, prefill):
        await server.wait_ready()
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        kv = kv_pb2.KVDescriptor(transport=kv_pb2.KV_TRANSPORT_SHM, block_epoch=3)

        call = stub.Prefill(timeout=CALL_TIMEOUT)
        await call.write(
            worker_pb2.PrefillClientMessage(
                request=worker_pb2.PrefillRequest(request_id="ok", prompt_token_ids=[1, 2], kv=kv)
            )
        )
        assert (await call.read()).first_token.token_id == 2
        done = (await call.read()).transfer_complete
        assert (done.request_id, done.epoch) == ("ok", 3)
        await call.write(
            worker_pb2.PrefillClientMessage(ack=worker_pb2.TransferAck(request_id="ok", ok=True))
        )
        await call.done_writing()
        assert await call.code() is grpc.StatusCode.OK

        # A refused ack raises AbortedError in the handler after it streamed.
        call = stub.Prefill(timeout=CALL_TIMEOUT)
        await call.write(
            worker_pb2.PrefillClientMessage(request=worker_pb2.PrefillRequest(request_id="nak"))
        )
        await call.read()
        await call.read()
        await call.write(
            worker_pb2.PrefillClientMessage(
                ack=worker_pb2.TransferAck(request_id="nak", ok=False, reason="bad checksum")
            )
        )
        assert await call.code() is grpc.StatusCode.ABORTED
        assert "bad checksum" in await call.details()

        # An error between the two server messages.
        prefill.errors["full"] = errors.ResourceExhaustedError("no blocks to prefill into")
        call = stub.Prefill(timeout=CALL_TIMEOUT)
        await call.write(
            worker_pb2.PrefillClientMessage(request=worker_pb2.PrefillRequest(request_id="full"))
        )
        assert (await call.read()).HasField("first_token")
        assert await call.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_client_cancel_unwinds_the_handler_and_server_survives() -> None:
    async with running() as (server, channel, decode, _):
        await server.wait_ready()
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        call = stub.Decode(worker_pb2.DecodeRequest(request_id="hold-c"), timeout=CALL_TIMEOUT)
        await call.read()
        await call.read()
        assert server.in_flight == 1
        call.cancel()

        async def unwound() -> bool:
            return decode.unwound == ["hold-c"] and server.in_flight == 0

        await eventually(unwound)
        stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=CALL_TIMEOUT)
        assert stats.total_kv_blocks == 8


# --- graceful stop -------------------------------------------------------------------


async def test_stop_refuses_new_calls_and_drains_in_flight_stream() -> None:
    async with running(grace_s=30.0) as (server, channel, decode, _):
        await server.wait_ready()
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id="hold-d", prompt_token_ids=[1, 2, 3]),
            timeout=CALL_TIMEOUT,
        )
        assert list((await call.read()).token_ids) == [10]
        stopping = asyncio.create_task(server.stop())

        async def not_serving() -> bool:
            return await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING

        await eventually(not_serving)
        alive = await health_status(channel, ALIVE_SERVICE)
        assert alive == health_pb2.HealthCheckResponse.NOT_SERVING  # draining: no longer alive
        err = await stats_error(channel)
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in err.details()
        assert not stopping.done()

        decode.release.set()
        rest = await read_rest(call)
        assert [t for m in rest for t in m.token_ids] == [11, 12]
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert rest[-1].usage.prompt_tokens == 3
        assert await call.code() is grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 10)


async def test_stop_cancels_what_outlives_the_grace_period() -> None:
    async with running(grace_s=0.3) as (server, channel, decode, _):
        await server.wait_ready()
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id="hold-g"), timeout=CALL_TIMEOUT
        )
        await call.read()
        await call.read()  # a client sees the status only once it has read every message
        began = time.monotonic()
        await asyncio.wait_for(server.stop(), 10)
        assert decode.unwound == ["hold-g"]
        assert await asyncio.wait_for(call.code(), 5) is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - began < 5


async def test_health_watch_does_not_hold_up_stop() -> None:
    async with running(grace_s=30.0) as (server, channel, _, _):
        await server.wait_ready()
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT
        )
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        began = time.monotonic()
        await asyncio.wait_for(server.stop(), 10)
        assert time.monotonic() - began < 5
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_sigterm_drains_an_in_flight_stream_then_exits(tmp_path: Path) -> None:
    port_file, release_file, log = tmp_path / "port", tmp_path / "release", tmp_path / "log"
    with open(log, "wb") as log_out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_rpc_server"]
            + ["--port-file", str(port_file), "--release-file", str(release_file)],
            cwd=REPO,
            stdout=log_out,
            stderr=subprocess.STDOUT,
        )
    try:

        async def port_written() -> bool:
            assert proc.poll() is None, log.read_text()
            return port_file.exists()

        await eventually(port_written, timeout=60)
        port = int(port_file.read_text())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

            async def serving() -> bool:
                return await health_status(channel) == health_pb2.HealthCheckResponse.SERVING

            await eventually(serving, timeout=30)
            call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
                worker_pb2.DecodeRequest(request_id="hold-s"), timeout=60
            )
            assert list((await call.read()).token_ids) == [10]

            proc.send_signal(signal.SIGTERM)

            async def not_serving() -> bool:
                return await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING

            await eventually(not_serving)
            assert (await stats_error(channel)).code() is grpc.StatusCode.UNAVAILABLE
            # The same request again (an entrypoint repeats it): the drain goes on.
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            assert proc.poll() is None, "server exited before its in-flight stream finished"

            release_file.touch()
            rest = [t for msg in await read_rest(call) for t in msg.token_ids]
            assert rest == [11, 12]
            assert await call.code() is grpc.StatusCode.OK
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert proc.returncode == 0, log.read_text()
        text = log.read_text()
        assert "received SIGTERM" in text and "draining" in text and "stopped" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _main() -> None:
    parser = argparse.ArgumentParser(description="toy baton worker server for the drain test")
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--release-file", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    spec = toy_spec(
        ToyDecode(release_file=args.release_file),
        ToyPrefill(),
        grace_s=30.0,
        port_file=args.port_file,
    )
    asyncio.run(serve(spec))


if __name__ == "__main__":
    _main()
