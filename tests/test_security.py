"""TLS, mTLS and API keys on real servers on loopback, and the decode worker's prefill
allow-list. Certificates are made by the test (``tests.certs``).

- a TLS port refuses plaintext clients and clients that do not trust its CA;
- an mTLS port (workers) refuses clients without a certificate of the fleet's CA;
- the gateway refuses calls without a valid API key (UNAUTHENTICATED, HTTP 401) and
  never logs a key; health stays open for probes;
- a decode worker dials only prefill workers of its fleet (PERMISSION_DENIED otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_service.prefill_fleet import PrefillFleet
from engine.errors import PermissionDeniedError
from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.served_model import ServedModel
from protos.baton.v1 import generate_pb2, generate_pb2_grpc
from rpc.auth import ApiKeys
from rpc.probe import main as probe_main
from rpc.server import RpcServer, ServerSpec
from rpc.tls import TlsFiles
from tests.certs import CertAuthority, Identity
from tests.fake_workers import FakeDecodeWorker, eventually, fake_workers
from tests.http_helpers import post, raw_request

KEY = "sk-baton-test-0123456789"
OTHER_KEY = "sk-baton-test-9876543210"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Identity, Identity, Identity]:
    """(server, fleet client, rogue client): the rogue's CA signed nothing of the fleet."""
    fleet = CertAuthority(tmp_path_factory.mktemp("fleet"))
    rogue = CertAuthority(tmp_path_factory.mktemp("rogue"), "rogue CA")
    return fleet.issue("server"), fleet.issue("client"), rogue.issue("intruder")


@contextlib.asynccontextmanager
async def health_server(credentials: grpc.ServerCredentials) -> AsyncIterator[str]:
    server = RpcServer(
        ServerSpec(
            name="tls",
            register=lambda s: None,
            service_names=("grpc.health.v1.Health",),
            credentials=credentials,
            grace_s=0,
        )
    )
    await server.start()
    await server.wait_ready()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop()


async def check(
    address: str, credentials: grpc.ChannelCredentials | None, timeout: float = 5.0
) -> grpc.StatusCode:
    """The status of one health Check over a plaintext or TLS channel."""
    channel = (
        grpc.aio.insecure_channel(address)
        if credentials is None
        else grpc.aio.secure_channel(address, credentials)
    )
    async with channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _material(identity: Identity, *, ca: bool) -> TlsFiles:
    return TlsFiles(identity.cert, identity.key, identity.ca if ca else None)


async def test_a_tls_port_refuses_plaintext_and_clients_without_its_ca(pki) -> None:  # noqa: ANN001
    server, client, rogue = pki
    material = _material(server, ca=False).load()
    assert material is not None and "key" in repr(material) and "BEGIN" not in repr(material)
    async with health_server(material.server_credentials(require_client_cert=False)) as address:
        assert await check(address, None) is grpc.StatusCode.UNAVAILABLE  # plaintext
        system_roots = grpc.ssl_channel_credentials()
        assert await check(address, system_roots) is grpc.StatusCode.UNAVAILABLE
        rogue_ca = grpc.ssl_channel_credentials(root_certificates=rogue.ca.read_bytes())
        assert await check(address, rogue_ca) is grpc.StatusCode.UNAVAILABLE
        assert await check(address, client.channel_credentials(with_cert=False)) is (
            grpc.StatusCode.OK
        )


async def test_an_mtls_port_refuses_clients_without_a_fleet_certificate(pki) -> None:  # noqa: ANN001
    server, client, rogue = pki
    material = _material(server, ca=True).load()
    assert material is not None
    async with health_server(material.server_credentials(require_client_cert=True)) as address:
        assert await check(address, None) is grpc.StatusCode.UNAVAILABLE
        assert await check(address, client.channel_credentials(with_cert=False)) is (
            grpc.StatusCode.UNAVAILABLE
        )
        intruder = grpc.ssl_channel_credentials(
            root_certificates=client.ca.read_bytes(),  # trusts the fleet's server...
            private_key=rogue.key.read_bytes(),  # ...but is not signed by the fleet
            certificate_chain=rogue.cert.read_bytes(),
        )
        assert await check(address, intruder) is grpc.StatusCode.UNAVAILABLE
        assert await check(address, client.channel_credentials()) is grpc.StatusCode.OK


async def test_the_exec_probe_reaches_an_mtls_port_with_the_pods_certificate(pki) -> None:  # noqa: ANN001
    server, client, _ = pki
    material = _material(server, ca=True).load()
    assert material is not None
    async with health_server(material.server_credentials(require_client_cert=True)) as address:
        with_cert = ["--address", address, "--tls-cert", str(client.cert)]
        with_cert += ["--tls-key", str(client.key), "--tls-ca", str(client.ca)]
        assert await asyncio.to_thread(probe_main, with_cert) == 0
        without = ["--address", address, "--tls-ca", str(client.ca), "--timeout-s", "1"]
        assert await asyncio.to_thread(probe_main, without) == 1
        assert await asyncio.to_thread(probe_main, ["--address", address, "--tls-cert", "x"]) == 2


def test_tls_flags_are_checked_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tls-cert and --tls-key must be given together"):
        TlsFiles(cert=tmp_path / "c.pem")
    with pytest.raises(ValueError, match="--tls-ca='.*' cannot be read"):
        TlsFiles(ca=tmp_path / "missing.pem").load()
    not_pem = tmp_path / "x.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="is not a PEM file"):
        TlsFiles(ca=not_pem).load()


# --- API keys -------------------------------------------------------------------------


def test_api_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# the keys of the test\n\n{KEY}\n  {OTHER_KEY}  \n")
    keys = ApiKeys.from_file(path)
    assert len(keys) == 2 and KEY not in repr(keys)
    assert keys.check(KEY) and keys.check(OTHER_KEY)
    assert not keys.check(KEY[:-1]) and not keys.check("") and not keys.check(None)
    assert keys.check_header(f"Bearer {KEY}") and keys.check_header(f"bearer  {KEY}")
    assert not keys.check_header(KEY) and not keys.check_header(f"Basic {KEY}")
    path.write_text("short\n")
    with pytest.raises(ValueError, match="line 1 is not a usable key") as info:
        ApiKeys.from_file(path)
    assert "short" not in str(info.value)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no keys"):
        ApiKeys.from_file(path)


@contextlib.asynccontextmanager
async def keyed_gateway(
    model: ServedModel, keys_file: Path
) -> AsyncIterator[tuple[str, str, FakeDecodeWorker]]:
    """A gateway with API keys (gRPC and HTTP) in front of a fake decode worker."""
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (decodes, _):
        config = GatewayConfig(
            decode=(decodes[0].address,),
            port=0,
            http_port=0,
            grace_s=0.5,
            stats_interval_s=0.05,
            api_keys_file=keys_file,
        )
        gateway = Gateway(config, model=model)
        server = RpcServer(gateway.spec())
        await server.start()
        try:
            await server.wait_ready()
            await eventually(lambda: all(w.up for w in gateway.router.workers))
            assert gateway.http is not None
            yield f"127.0.0.1:{server.port}", f"127.0.0.1:{gateway.http.port}", decode
        finally:
            await server.stop()
            await gateway.aclose()


async def test_calls_without_a_valid_api_key_are_unauthenticated(
    served_smollm2: ServedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(KEY + "\n")
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]))
    caplog.set_level(logging.DEBUG)
    async with keyed_gateway(served_smollm2, keys_file) as (address, http, decode):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.BatonStub(channel)
            for metadata in (
                None,
                [("authorization", f"Bearer {OTHER_KEY}")],
                [("authorization", KEY)],
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [r async for r in stub.Generate(request, timeout=10, metadata=metadata)]
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in (info.value.details() or "")
            assert decode.requests == []  # refused before anything ran
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=10)
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
            good = [("authorization", f"Bearer {KEY}")]
            responses = [r async for r in stub.Generate(request, timeout=10, metadata=good)]
            assert responses[-1].finish_reason
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        port = int(http.rsplit(":", 1)[1])
        body = {"model": served_smollm2.card.model_id, "prompt": [1, 2, 3], "max_tokens": 2}
        status, headers, refused = await post(port, "/v1/completions", body)
        assert status == 401 and refused["error"]["code"] == "invalid_api_key"
        assert headers.get("www-authenticate") == "Bearer"
        wrong = await post(port, "/v1/completions", body, Authorization=f"Bearer {OTHER_KEY}")
        assert wrong[0] == 401
        status, _, ok = await post(port, "/v1/completions", body, Authorization=f"Bearer {KEY}")
        assert status == 200, ok
        assert (await asyncio.to_thread(raw_request, port, "GET", "/health"))[0] == 200
    assert KEY not in caplog.text and OTHER_KEY not in caplog.text


# --- the prefill fleet ----------------------------------------------------------------


async def test_a_decode_worker_dials_only_its_prefill_fleet() -> None:
    fleet = PrefillFleet(["10.0.0.7", "10.0.0.8:5000", "dns:///localhost:6000"])
    assert not fleet.open
    await fleet.check("10.0.0.7:1234")  # any port on an allowed host
    await fleet.check("10.0.0.8:5000")
    await fleet.check("127.0.0.1:6000")  # what the dns:/// entry resolves to
    for outside in ("10.0.0.8:5001", "10.0.0.9:5000", "127.0.0.1:6001", "evil.example:6000"):
        with pytest.raises(PermissionDeniedError, match="not a prefill worker of this"):
            await fleet.check(outside)
    # A name is compared as written, never resolved to match an address entry.
    with pytest.raises(PermissionDeniedError):
        await PrefillFleet(["127.0.0.1"]).check("localhost:5000")
    with pytest.raises(ValueError, match="prefill_address must be host:port"):
        await fleet.check("10.0.0.7")
    await PrefillFleet([]).check("anywhere:1")  # no fleet configured: open


async def test_the_prefill_fleet_follows_dns_without_refusing_pods_in_transition() -> None:
    """A pod new to the answer is admitted even right after a lookup (the miss waits for
    the next one); a pod that left the answer (draining) stays admitted for retain_s."""
    answers = {"prefill": ["10.0.0.1"]}
    lookups: list[float] = []

    async def lookup(name: str, port: int) -> list[str]:
        lookups.append(asyncio.get_running_loop().time())
        return list(answers.get(name, []))

    fleet = PrefillFleet(
        ["dns:///prefill:50052"], lookup=lookup, resolve_interval_s=0.3, retain_s=1.0
    )
    await fleet.check("10.0.0.1:50052")
    answers["prefill"] = ["10.0.0.2"]  # 10.0.0.1 drains, 10.0.0.2 became ready
    await fleet.check("10.0.0.2:50052")  # within the interval: waited, then admitted
    assert len(lookups) == 2 and lookups[1] - lookups[0] >= 0.25
    await fleet.check("10.0.0.1:50052")  # gone from DNS, still within retain_s
    with pytest.raises(PermissionDeniedError):
        await fleet.check("10.0.0.1:50053")  # the port is part of the entry
    await asyncio.sleep(1.1)
    with pytest.raises(PermissionDeniedError):
        await fleet.check("10.0.0.1:50052")  # retained no longer
    looked_up = len(lookups)
    await asyncio.gather(*(fleet.check("10.0.0.2:50052") for _ in range(5)))
    assert len(lookups) == looked_up  # hits of a known address look nothing up
