"""rpc.channels: one cached channel per address, usable against a real loopback server."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from rpc.channels import CHANNEL_OPTIONS, ChannelCache, make_channel
from rpc.server import RpcServer, ServerSpec


def test_make_channel_rejects_a_bad_address() -> None:
    with pytest.raises(ValueError, match="host:port"):
        make_channel("localhost")


def test_options_carry_keepalive_and_size_limits() -> None:
    names = dict(CHANNEL_OPTIONS)
    assert names["grpc.keepalive_time_ms"] > 0
    assert names["grpc.max_receive_message_length"] >= 4 * 1024 * 1024


def test_a_restarted_peer_is_redialled_before_the_gateway_gives_up_on_it() -> None:
    """The reconnect backoff, with gRPC's 20% jitter, stays under the gateway's default
    --worker-down-after-s: a worker back on its address is dialled again (and answers
    Stats) before the router's patience with it runs out."""
    names = dict(CHANNEL_OPTIONS)
    assert (
        names["grpc.max_reconnect_backoff_ms"] * 1.2
        < GatewayConfig(decode=("127.0.0.1:1",)).worker_down_after_s * 1e3
    )
    assert names["grpc.initial_reconnect_backoff_ms"] <= names["grpc.max_reconnect_backoff_ms"]


async def test_cache_reuses_drops_and_closes() -> None:
    cache = ChannelCache()
    a = cache.get("127.0.0.1:1")
    assert cache.get("127.0.0.1:1") is a
    b = cache.get("127.0.0.1:2")
    assert b is not a and len(cache) == 2
    await cache.drop("127.0.0.1:1")
    assert "127.0.0.1:1" not in cache
    assert cache.get("127.0.0.1:1") is not a
    await cache.drop("127.0.0.1:9")  # unknown: nothing to do
    await cache.close()
    await cache.close()
    assert len(cache) == 0


async def test_cached_channel_talks_to_a_server() -> None:
    server = RpcServer(
        ServerSpec(name="h", register=lambda s: None, service_names=("grpc.health.v1.Health",))
    )
    await server.start()
    await server.wait_ready()
    cache = ChannelCache()
    try:
        stub = health_pb2_grpc.HealthStub(cache.get(f"127.0.0.1:{server.port}"))
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await cache.close()
        await server.stop()


async def test_a_discarded_channel_is_replaced_at_once_and_closed_in_the_background() -> None:
    cache = ChannelCache()
    old = cache.get("127.0.0.1:1")
    cache.discard("127.0.0.1:1")
    new = cache.get("127.0.0.1:1")  # before the old one's close has run
    assert new is not old and len(cache) == 1
    cache.discard("127.0.0.1:9")  # unknown: nothing to do
    await cache.close()  # waits for the discarded one too
    assert old.get_state() is grpc.ChannelConnectivity.SHUTDOWN
    assert new.get_state() is grpc.ChannelConnectivity.SHUTDOWN
