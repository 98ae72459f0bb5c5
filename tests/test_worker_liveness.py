"""A worker that can no longer serve says so: over a real ``RpcServer``, wired as the
services' ``__main__`` wire it (``fatal``, ``liveness``, the metrics collector).

- Decode's KV receiver thread dies (an EMFILE injected into it) while a request is in
  its hand-off: that request ends with UNAVAILABLE at once (not after the transfer
  timeout), its blocks come back, health turns NOT_SERVING for good, new calls are
  refused with UNAVAILABLE, and ``baton_kv_transfer_thread_up`` reads 0.
- A single-process worker whose engine is stuck in a step (alive, wedged) turns
  NOT_SERVING past ``--engine-stall-timeout-s`` and SERVING again once it steps; the
  request that was stuck finishes.
"""

from __future__ import annotations

import asyncio
import errno
import re
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from decode_service.servicer import SERVICE_NAME as DECODE_SERVICE
from decode_service.servicer import DecodeServicer
from engine.config import EngineConfig
from protos.baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from rpc.metrics import WorkerCollector
from rpc.server import RpcServer, ServerSpec
from rpc.worker_config import WorkerConfig

PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Long, so that a request ending within a few seconds proves it did not wait for it.
TRANSFER_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 120.0


class SilentPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Sends the first token, then nothing: the request stays in its hand-off, with its
    lease pending on decode's receiver."""

    def __init__(self) -> None:
        self.ordered = asyncio.Event()

    async def Prefill(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        await anext(aiter(request_iterator))
        self.ordered.set()
        yield worker_pb2.PrefillServerMessage(first_token=worker_pb2.FirstToken(token_id=42))
        await asyncio.sleep(3600)


def _config(model: Path, role: str, **overrides: object) -> WorkerConfig:
    engine = EngineConfig(model=str(model), dtype="float32", num_blocks=64, num_threads=1)
    values: dict[str, object] = {
        "transport": "shm",
        "transport_address": f"baton-lv-{uuid.uuid4().hex[:16]}",
        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
        "grace_s": 0.0,
    }
    values.update(overrides)
    return WorkerConfig(role=role, engine=engine, **values)  # type: ignore[arg-type]


def _spec(decode: DecodeServicer, interval_s: float = 1.0) -> ServerSpec:
    """What decode_service.__main__ builds, on port 0."""
    return ServerSpec(
        name="decode",
        register=lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, s),
        service_names=(DECODE_SERVICE,),
        ready=decode.start,
        grace_s=0.0,
        fatal=decode.fatal,
        liveness=decode.stalled,
        liveness_interval_s=interval_s,
    )


def _request(rid: str, prefill: str = "") -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=list(range(1000, 1040)),
        sampling_params=common_pb2.SamplingParameters(max_tokens=6, temperature=0, ignore_eos=True),
        prefill_address=prefill,
    )


async def _health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status


async def _eventually_health(channel: grpc.aio.Channel, want: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while await _health(channel) != want:
        assert time.monotonic() < deadline, f"health never became {want}"
        await asyncio.sleep(0.02)


async def _collect(call: grpc.aio.UnaryStreamCall) -> list[int]:
    tokens: list[int] = []
    async for response in call:
        tokens.extend(response.token_ids)
    return tokens


def _gauge(registry: CollectorRegistry, name: str) -> str:
    lines = generate_latest(registry).decode().splitlines()
    return next(line for line in lines if line.startswith(name + "{"))


async def test_a_dead_kv_receiver_thread_fails_the_handoffs_and_turns_not_serving(
    tiny_llama: Path,
) -> None:
    decode = DecodeServicer(_config(tiny_llama, "decode"))
    prefill = SilentPrefill()
    prefill_server = RpcServer(
        ServerSpec(
            name="silent-prefill",
            register=lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, s),
            service_names=(PREFILL_SERVICE,),
            grace_s=0.0,
        )
    )
    server = RpcServer(_spec(decode))
    registry = CollectorRegistry()
    registry.register(
        WorkerCollector(
            "decode",
            lambda: None,
            transfer_up=lambda: decode.inbox.worker_up if decode.inbox is not None else None,
        )
    )
    try:
        await prefill_server.start()
        await server.start()
        await server.wait_ready()
        assert _gauge(registry, "baton_kv_transfer_thread_up").endswith(" 1.0")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            call = stub.Decode(
                _request("r1", f"127.0.0.1:{prefill_server.port}"), timeout=CALL_TIMEOUT_S
            )
            pending = asyncio.ensure_future(_collect(call))
            await asyncio.wait_for(prefill.ordered.wait(), 30)
            await asyncio.sleep(0.2)  # the first token is in: decode waits for the KV
            assert decode.engine is not None and decode.inbox is not None
            total = decode.engine.stats().num_total_blocks
            assert decode.engine.stats().num_free_blocks < total  # the lease holds blocks

            receiver = decode.inbox.receiver

            def sweep():  # noqa: ANN202
                raise OSError(errno.EMFILE, "Too many open files (injected)")

            began = time.monotonic()
            with receiver._cond:  # type: ignore[attr-defined]
                receiver._sweep = sweep  # type: ignore[attr-defined]
                receiver._cond.notify()  # type: ignore[attr-defined]
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(pending, 20)
            assert ended.value.code() is grpc.StatusCode.UNAVAILABLE, ended.value
            assert re.search("receiver.* thread died", ended.value.details())
            assert time.monotonic() - began < 10  # not the transfer timeout

            await _eventually_health(channel, NOT_SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _collect(stub.Decode(_request("r2"), timeout=CALL_TIMEOUT_S))
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "KV receiver thread died" in refused.value.details()
            deadline = time.monotonic() + 10
            while decode.engine.stats().num_free_blocks != total:
                assert time.monotonic() < deadline, decode.engine.stats()
                await asyncio.sleep(0.05)
            assert _gauge(registry, "baton_kv_transfer_thread_up").endswith(" 0.0")
    finally:
        await server.stop()
        await prefill_server.stop()
        await decode.close()


async def test_a_wedged_engine_is_not_serving_until_it_steps_again(tiny_llama: Path) -> None:
    decode = DecodeServicer(_config(tiny_llama, "both", engine_stall_timeout_s=0.5))
    server = RpcServer(_spec(decode, interval_s=0.05))
    release = threading.Event()
    entered = threading.Event()
    try:
        await server.start()
        await server.wait_ready()
        assert decode.engine is not None
        real_run = decode.engine.core.runner._run

        def wedged(sched):  # noqa: ANN001, ANN202
            if not release.is_set():
                entered.set()
                release.wait(60)  # stuck in the step, the thread alive
            return real_run(sched)

        decode.engine.core.runner._run = wedged  # type: ignore[method-assign]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            await asyncio.sleep(1.0)  # idle longer than the bound: still SERVING
            assert await _health(channel) == SERVING
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            stuck = asyncio.ensure_future(
                _collect(stub.Decode(_request("stuck"), timeout=CALL_TIMEOUT_S))
            )
            assert await asyncio.to_thread(entered.wait, 20)
            await _eventually_health(channel, NOT_SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Stats(worker_pb2.StatsRequest(), timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "has not finished a step" in refused.value.details()
            release.set()
            await _eventually_health(channel, SERVING)
            assert len(await asyncio.wait_for(stuck, 60)) == 6
            await stub.Stats(worker_pb2.StatsRequest(), timeout=10)
    finally:
        release.set()
        await server.stop()
        await decode.close()


def test_the_prefill_worker_reads_the_same_stall_bound(tiny_llama: Path) -> None:
    """What prefill_service.__main__ polls (``stalled``) follows its engine's snapshot age
    against --engine-stall-timeout-s; no engine yet: not stalled (readiness covers it)."""
    from prefill_service.servicer import PrefillServicer

    prefill = PrefillServicer(_config(tiny_llama, "prefill", engine_stall_timeout_s=5.0))
    assert prefill.stalled() is None
    prefill.engine = SimpleNamespace(snapshot_age_s=0.2)  # type: ignore[assignment]
    assert prefill.stalled() is None
    prefill.engine = SimpleNamespace(snapshot_age_s=7.0)  # type: ignore[assignment]
    reason = prefill.stalled()
    assert reason is not None and "7.0 s" in reason
