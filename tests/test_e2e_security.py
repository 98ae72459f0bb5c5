"""A locked-down deployment through real processes: TLS on the gateway's public ports
(gRPC and HTTPS), API keys, mTLS between gateway and workers and between workers, the
fleet's shared secret on the gloo rendezvous and the hand-off, a prefill allow-list on
decode, reflection off on workers. A client with the CA and a key gets tokens; everyone
else is refused with the status the README documents."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.baton.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.certs import CertAuthority, Identity
from tests.e2e_helpers import E2ECluster, assert_completed, collect, ids_request, tiny_cluster

KEY = "sk-e2e-0123456789abcdef"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> Identity:
    return CertAuthority(tmp_path_factory.mktemp("pki")).issue("fleet")


@pytest.fixture(scope="module")
def cluster(
    tiny_llama: Path, identity: Identity, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[E2ECluster]:
    secrets = tmp_path_factory.mktemp("secrets")
    keys, fleet = secrets / "api-keys", secrets / "fleet-secret"
    keys.write_text(f"# clients\n{KEY}\n")
    fleet.write_bytes(b"the-fleet-secret-of-this-test\n")
    tls = ("--tls-cert", str(identity.cert), "--tls-key", str(identity.key))
    with tiny_cluster(
        tiny_llama,
        worker_args=(
            "--transport",
            "gloo",
            *tls,
            "--tls-ca",
            str(identity.ca),
            "--fleet-secret-file",
            str(fleet),
        ),
        decode_args=("--prefill-allow", "127.0.0.1"),
        gateway_args=(
            *tls,
            "--worker-tls-cert",
            str(identity.cert),
            "--worker-tls-key",
            str(identity.key),
            "--worker-tls-ca",
            str(identity.ca),
            "--api-keys-file",
            str(keys),
        ),
        http_port=0,
        probe_credentials=identity.channel_credentials(),
    ) as c:
        yield c


def _call(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    metadata: list[tuple[str, str]] | None,
) -> tuple[grpc.StatusCode, int, str]:
    async def run() -> tuple[grpc.StatusCode, int, str]:
        channel = (
            grpc.aio.secure_channel(address, credentials)
            if credentials is not None
            else grpc.aio.insecure_channel(address)
        )
        async with channel:
            stub = generate_pb2_grpc.BatonStub(channel)
            call = stub.Generate(
                ids_request(20, "secure", max_tokens=MAX_TOKENS), timeout=20, metadata=metadata
            )
            outcome = await collect(call)
            if outcome.code is grpc.StatusCode.OK:
                assert_completed(outcome, MAX_TOKENS)
            return outcome.code, outcome.num_tokens, outcome.details

    return asyncio.run(run())


def test_a_client_with_the_ca_and_a_key_is_served(cluster: E2ECluster, identity: Identity) -> None:
    tls = identity.channel_credentials(with_cert=False)
    code, tokens, _ = _call(cluster.gateway_address, tls, [("authorization", f"Bearer {KEY}")])
    assert (code, tokens) == (grpc.StatusCode.OK, MAX_TOKENS), cluster.logs()


def test_everyone_else_is_refused(cluster: E2ECluster, identity: Identity) -> None:
    good = [("authorization", f"Bearer {KEY}")]
    # Plaintext to the TLS port, and TLS without the CA: no connection at all.
    assert _call(cluster.gateway_address, None, good)[0] is grpc.StatusCode.UNAVAILABLE
    no_ca = grpc.ssl_channel_credentials()
    assert _call(cluster.gateway_address, no_ca, good)[0] is grpc.StatusCode.UNAVAILABLE
    tls = identity.channel_credentials(with_cert=False)
    for metadata in (None, [("authorization", "Bearer sk-e2e-not-a-key-at-all")]):
        code, _, details = _call(cluster.gateway_address, tls, metadata)
        assert code is grpc.StatusCode.UNAUTHENTICATED and "API key" in details
    assert KEY not in cluster.logs()


def test_https_needs_the_ca_and_a_key(cluster: E2ECluster, identity: Identity) -> None:
    host, port = cluster.http_address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(identity.ca))
    body = json.dumps({"model": "tiny", "prompt": [1000, 1001, 1002], "max_tokens": 3})

    def post(headers: dict[str, str], ctx: ssl.SSLContext) -> int:
        conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=20)
        try:
            conn.request(
                "POST",
                "/v1/completions",
                body=body,
                headers={"Content-Type": "application/json", **headers},
            )
            return conn.getresponse().status
        finally:
            conn.close()

    assert post({}, context) == 401
    with pytest.raises(ssl.SSLError):
        post({"Authorization": f"Bearer {KEY}"}, ssl.create_default_context())
    # 404: the key and TLS are fine, the model name is not the served one.
    assert post({"Authorization": f"Bearer {KEY}"}, context) == 404


def test_workers_talk_only_to_their_fleet(cluster: E2ECluster, identity: Identity) -> None:
    (decode,) = cluster.addresses("decode")

    async def run() -> None:
        # Without a fleet certificate a worker cannot even be reached.
        async with grpc.aio.secure_channel(
            decode, identity.channel_credentials(with_cert=False)
        ) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.DecodeWorkerStub(channel).Stats(
                    worker_pb2.StatsRequest(), timeout=10
                )
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.secure_channel(decode, identity.channel_credentials()) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            # A member of the fleet cannot send decode to a prefill worker outside it.
            request = worker_pb2.DecodeRequest(
                request_id="outside",
                prompt_token_ids=[1000, 1001, 1002],
                prefill_address="127.0.0.2:50051",
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Decode(request, timeout=10):
                    pass
            assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "fleet" in (info.value.details() or "")
            # Reflection is off on workers.
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = reflect.ServerReflectionInfo(timeout=10)
            # The status alone, without a write that races it (grpc-python then reports
            # INTERNAL for the failed write instead).
            assert await call.code() is grpc.StatusCode.UNIMPLEMENTED
            stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=10)
            assert stats.free_kv_blocks == stats.total_kv_blocks

    asyncio.run(run())


def test_the_gateway_keeps_reflection_behind_its_keys(
    cluster: E2ECluster, identity: Identity
) -> None:
    async def list_services(metadata: list[tuple[str, str]] | None) -> list[str]:
        tls = identity.channel_credentials(with_cert=False)
        async with grpc.aio.secure_channel(cluster.gateway_address, tls) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(timeout=10, metadata=metadata)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            reply = await call.read()
            await call.done_writing()
            return [s.name for s in reply.list_services_response.service]

    async def refusal_without_key() -> grpc.StatusCode:
        """The status of a keyless call, read without writing: the refusal comes from the
        call's metadata alone, and a write racing it would fail inside the client's gRPC
        core (reported as INTERNAL there, whatever the server said)."""
        tls = identity.channel_credentials(with_cert=False)
        async with grpc.aio.secure_channel(cluster.gateway_address, tls) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(timeout=10)
            return await call.code()

    async def run() -> None:
        assert "baton.v1.Baton" in await list_services([("authorization", f"Bearer {KEY}")])
        assert await refusal_without_key() is grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(run())
