"""Admission at the gateway, against fake workers: a cap on concurrent streams shared by
gRPC and HTTP (over it: RESOURCE_EXHAUSTED / 429 at once), RESOURCE_EXHAUSTED from a
decode worker retried on another one before the first token, and the public message
limit sized from max_model_len with counts checked before contents."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import grpc.aio
import pytest

from engine import errors
from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.served_model import ServedModel
from protos.baton.v1 import generate_pb2, generate_pb2_grpc
from rpc.channels import public_message_bytes
from rpc.server import RpcServer
from tests.fake_workers import FakeDecodeWorker, FakeServer, Script, eventually, fake_workers
from tests.http_helpers import post

CAP = 4


@contextlib.asynccontextmanager
async def gateway_with(
    model: ServedModel, decode: Sequence[FakeServer], **config: object
) -> AsyncIterator[tuple[Gateway, generate_pb2_grpc.BatonStub]]:
    cfg = GatewayConfig(
        decode=tuple(d.address for d in decode),
        port=0,
        grace_s=0.5,
        stats_interval_s=0.05,
        **config,  # type: ignore[arg-type]
    )
    gateway = Gateway(cfg, model=model)
    server = RpcServer(gateway.spec())
    await server.start()
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.max_send_message_length", 64 << 20)]
    )
    try:
        await server.wait_ready()
        await eventually(lambda: all(w.up for w in gateway.router.workers))
        yield gateway, generate_pb2_grpc.BatonStub(channel)
    finally:
        await channel.close()
        await server.stop()
        await gateway.aclose()


def _request(n: int = 3) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(range(1, n + 1))))


async def test_streams_over_the_cap_are_refused_at_once_on_grpc_and_http(
    served_smollm2: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=(5,), hang=True)  # streams stay open until cancelled
    async with fake_workers([decode]) as (decodes, _):
        async with gateway_with(
            served_smollm2, decodes, max_concurrent_streams=CAP, http_port=0
        ) as (gateway, stub):
            calls = [stub.Generate(_request(), timeout=30) for _ in range(CAP)]
            for call in calls:
                await call.read()  # each holds a slot now
            assert gateway.generation.num_streams == CAP
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(_request(), timeout=30).read()
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"limit of {CAP} concurrent streams" in (info.value.details() or "")
            assert time.monotonic() - began < 1.0
            # HTTP counts against the same cap.
            assert gateway.http is not None
            body = {"model": served_smollm2.card.model_id, "prompt": [1, 2], "max_tokens": 1}
            status, _, refused = await post(gateway.http.port, "/v1/completions", body)
            assert status == 429 and refused["error"]["type"] == "rate_limit_error"
            assert len(decode.requests) == CAP, "refused streams never reach a worker"
            # A slot that frees up is taken by the next stream.
            calls.pop().cancel()
            await eventually(lambda: gateway.generation.num_streams == CAP - 1)
            again = stub.Generate(_request(), timeout=30)
            assert (await again.read()).token_ids == [5]
            for call in (*calls, again):
                call.cancel()
            await eventually(lambda: gateway.generation.num_streams == 0)


async def test_resource_exhausted_is_retried_on_another_decode_worker(
    served_smollm2: ServedModel,
) -> None:
    full, roomy = FakeDecodeWorker(), FakeDecodeWorker()
    full.script = Script(error=errors.ResourceExhaustedError("no KV blocks within 10.0 s"))
    async with fake_workers([full, roomy]) as (decodes, _):
        async with gateway_with(served_smollm2, decodes, max_retries=2) as (_, stub):
            for _ in range(4):  # whichever the router picks first, each ends on `roomy`
                responses = [r async for r in stub.Generate(_request(), timeout=10)]
                assert [t for r in responses for t in r.token_ids] == [10, 11, 12]
            assert len(roomy.requests) == 4
            # Both full: each is asked once, then the status reaches the client.
            roomy.script = full.script
            before = (len(full.requests), len(roomy.requests))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [r async for r in stub.Generate(_request(), timeout=10)]
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (len(full.requests), len(roomy.requests)) == (before[0] + 1, before[1] + 1)


async def test_the_public_message_limit_follows_max_model_len(
    served_smollm2: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (decodes, _):
        async with gateway_with(served_smollm2, decodes) as (gateway, stub):
            limit = public_message_bytes(served_smollm2.card.max_model_len)
            assert gateway.max_message_bytes == limit and 1 << 20 < limit < 8 << 20
            # Over the limit: refused by gRPC before the message is parsed.
            huge = generate_pb2.GenerateRequest(text="x" * (limit + 1))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(huge, timeout=10).read()
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            # Under it but longer than the context: refused by its count, not its ids.
            ids = [50_000] * (served_smollm2.card.max_model_len + 5)
            ids[-1] = 10**9  # an id outside the vocabulary, never looked at
            long = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(long, timeout=10).read()
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "token_ids.ids has" in (info.value.details() or "")
            assert decode.requests == []
