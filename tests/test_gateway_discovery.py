"""gateway.routing.discovery and the router over a changing fleet, against real gRPC fake workers.

Targets parse; DNS names resolve through an injected resolver (and through the system's
for ``localhost``); a worker that appears is routed to once it answers, one whose health
says NOT_SERVING is out at once, one that leaves the answer is forgotten only after its
streams ended; a missed poll is tolerated until ``down_after_s``; a request that finds
no worker waits briefly for one, then fails saying how long none answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine import errors
from engine.sampling_params import SamplingParams
from gateway.routing.discovery import Fleet, file_resolver, parse_target, system_resolver
from gateway.routing.dispatcher import DecodeJob, Dispatcher
from gateway.routing.router import Route, Router, WorkerKind
from protos.baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.channels import ChannelCache
from rpc.server import RpcServer, ServerSpec
from tests.fake_workers import (
    DECODE_SERVICE,
    FakeDecodeWorker,
    FakePrefillWorker,
    Script,
    eventually,
    fake_workers,
)


class FakeDNS:
    """A resolver whose answers a test sets: name -> addresses, or an OSError to raise."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str] | OSError] = {}
        self.lookups: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        answer = self.answers.get(host, [])
        if isinstance(answer, OSError):
            raise answer
        return list(answer)


# --- targets and fleets ------------------------------------------------------------------


def test_targets_parse_as_grpc_names() -> None:
    t = parse_target("dns:///baton-decode:50053")
    assert (t.dns, t.host, t.port) == (True, "baton-decode", 50053)
    t = parse_target("10.0.0.7:50052")
    assert (t.dns, t.address) == (False, "10.0.0.7:50052")
    assert parse_target("[::1]:9").address == "[::1]:9"
    for bad in ("nocolon", "dns:///name", "dns://auth/name:1", "dns:name:1", "h:0", "h:99999"):
        with pytest.raises(ValueError, match="target"):
            parse_target(bad)


async def test_fleet_keeps_the_last_answer_when_a_lookup_fails() -> None:
    dns = FakeDNS()
    fleet = Fleet("decode", ["dns:///d:1", "10.9.9.9:1"], dns)
    assert fleet.addresses() == ["10.9.9.9:1"]  # fixed addresses need no lookup
    dns.answers["d"] = ["10.0.0.1:1", "10.0.0.2:1"]
    assert await fleet.resolve() == ["10.0.0.1:1", "10.0.0.2:1", "10.9.9.9:1"]
    dns.answers["d"] = OSError("DNS server unreachable")
    assert await fleet.resolve() == ["10.0.0.1:1", "10.0.0.2:1", "10.9.9.9:1"]
    dns.answers["d"] = []  # the name has no ready pod now
    assert await fleet.resolve() == ["10.9.9.9:1"]
    with pytest.raises(ValueError, match="lists a target twice"):
        Fleet("decode", ["a:1", "a:1"], dns)


async def test_system_resolver_reads_localhost_and_names_that_do_not_exist() -> None:
    assert "127.0.0.1:50051" in await system_resolver("localhost", 50051)
    assert await system_resolver("no-such-host.invalid", 1) == []


async def test_file_resolver_answers_from_a_file_read_at_every_lookup(tmp_path: Path) -> None:
    """``--resolve-file``: the launcher's stand-in for the cluster DNS."""
    path = tmp_path / "dns.json"
    fleet = Fleet("decode", ["dns:///baton-decode:50053"], file_resolver(path))
    with pytest.raises(OSError, match="No such file"):
        await file_resolver(path)("baton-decode", 50053)
    path.write_text(json.dumps({"baton-decode:50053": ["127.0.0.1:4001", "127.0.0.1:4002"]}))
    assert await fleet.resolve() == ["127.0.0.1:4001", "127.0.0.1:4002"]
    path.write_text(json.dumps({"baton-decode:50053": ["127.0.0.1:4002"]}))
    assert await fleet.resolve() == ["127.0.0.1:4002"]  # one left: the file is read again
    path.write_text("{half written")
    assert await fleet.resolve() == ["127.0.0.1:4002"]  # unreadable: the last answer stays
    path.write_text(json.dumps({"other:1": ["127.0.0.1:9"]}))
    assert await fleet.resolve() == []  # the name is not there: no such name
    path.write_text(json.dumps({"baton-decode:50053": "127.0.0.1:4002"}))
    with pytest.raises(OSError, match="list of HOST:PORT"):
        await file_resolver(path)("baton-decode", 50053)


# --- the router over real fake workers -----------------------------------------------------


def make_router(decode: list[str], prefill: list[str] = (), **kwargs: object) -> Router:  # type: ignore[assignment]
    options: dict[str, object] = {
        "poll_interval_s": 0.05,
        "stats_timeout_s": 0.5,
        "down_after_s": 0.6,
        "resolve_interval_s": 0.1,
        "wait_for_worker_s": 0.2,
    }
    options.update(kwargs)
    return Router(decode, list(prefill), ChannelCache(), **options)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running(router: Router) -> AsyncIterator[Router]:
    router.start()
    try:
        yield router
    finally:
        await router.close()
        await router._channels.close()


async def serve_decode(
    worker: FakeDecodeWorker, name: str, grace_s: float
) -> tuple[RpcServer, str]:
    """``worker`` on a real server of its own (so a test can stop it), and its address."""
    server = RpcServer(
        ServerSpec(
            name=name,
            register=lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, s),
            service_names=(DECODE_SERVICE,),
            grace_s=grace_s,
        )
    )
    await server.start()
    await server.wait_ready()
    return server, f"127.0.0.1:{server.port}"


def up_addresses(router: Router, kind: WorkerKind = WorkerKind.DECODE) -> set[str]:
    return {w.address for w in router.workers if w.kind is kind and w.up}


async def test_a_worker_that_appears_in_dns_is_routed_to_once_it_answers() -> None:
    dns = FakeDNS()
    async with fake_workers([FakeDecodeWorker(), FakeDecodeWorker()]) as (d, _):
        dns.answers["decode.ns"] = [d[0].address]
        async with running(make_router(["dns:///decode.ns:50053"], resolver=dns)) as router:
            await eventually(lambda: up_addresses(router) == {d[0].address})
            dns.answers["decode.ns"] = [d[0].address, d[1].address]  # scaled up
            await eventually(lambda: up_addresses(router) == {d[0].address, d[1].address})
            picked = {router.pick(1).decode for _ in range(4)}
            assert picked == {d[0].address, d[1].address}


async def test_a_real_localhost_name_resolves_to_the_worker() -> None:
    async with fake_workers([FakeDecodeWorker()]) as (d, _):
        port = d[0].server.port
        async with running(make_router([f"dns:///localhost:{port}"])) as router:
            await eventually(lambda: f"127.0.0.1:{port}" in up_addresses(router))
            assert router.pick(1).decode == f"127.0.0.1:{port}"


async def test_a_draining_worker_is_out_at_once_and_its_stream_finishes() -> None:
    """SIGTERM on a worker: health NOT_SERVING; the router stops picking it on the next
    poll (not after down_after_s), while the stream it serves runs to its end."""
    draining, other = FakeDecodeWorker(), FakeDecodeWorker()
    draining.script = Script(token_ids=list(range(10, 30)), delay_s=0.05)
    server, address = await serve_decode(draining, "draining", grace_s=10.0)
    dns = FakeDNS()
    dns.answers["decode"] = [address]
    async with fake_workers([other]) as (d, _):
        router = make_router(["dns:///decode:1"], resolver=dns, down_after_s=30.0)
        async with running(router):
            await eventually(lambda: up_addresses(router) == {address})
            dispatcher = Dispatcher(router, router._channels, max_retries=0)
            job = DecodeJob("r1", [1, 2, 3], SamplingParams(max_tokens=20))
            stream = dispatcher.stream(job, timeout=10.0)
            first = await anext(stream)  # the stream runs on the soon-draining worker
            dns.answers["decode"] = [address, d[0].address]
            await eventually(lambda: up_addresses(router) == {address, d[0].address})
            stopping = asyncio.create_task(server.stop())  # what SIGTERM does
            await eventually(lambda: up_addresses(router) == {d[0].address}, timeout=3.0)
            worker = next(w for w in router.workers if w.address == address)
            assert "NOT_SERVING" in worker.last_error
            assert router.pick(1).decode == d[0].address
            rest = [out async for out in stream]
            await stopping
    tokens = [t for out in (first, *rest) for t in out.new_token_ids]
    assert tokens == list(range(10, 30)) and rest[-1].finished


async def test_a_worker_whose_process_died_is_out_at_once() -> None:
    """kill -9 of a worker: nothing accepts connections at its address any more. The
    router stops picking it at the next poll that fails to connect, not after
    down_after_s (a replacement may not be in the fleet yet, and a request that retried
    on it would spend its attempts on a closed port)."""
    dying, other = FakeDecodeWorker(), FakeDecodeWorker()
    server, address = await serve_decode(dying, "dying", grace_s=0.0)
    async with fake_workers([other]) as (d, _):
        router = make_router([address, d[0].address], down_after_s=30.0)
        async with running(router):
            await eventually(lambda: up_addresses(router) == {address, d[0].address})
            await server.stop()  # the port closes, as when the process is gone
            await eventually(lambda: up_addresses(router) == {d[0].address}, timeout=3.0)
            worker = next(w for w in router.workers if w.address == address)
            assert "cannot connect" in worker.last_error
            assert {router.pick(1).decode for _ in range(4)} == {d[0].address}


async def test_a_worker_that_left_dns_is_forgotten_after_its_last_stream() -> None:
    dns = FakeDNS()
    leaving, staying = FakeDecodeWorker(), FakeDecodeWorker()
    leaving.script = Script(token_ids=list(range(100, 110)), delay_s=0.05)
    async with fake_workers([leaving, staying]) as (d, _):
        dns.answers["decode"] = [d[0].address]
        router = make_router(["dns:///decode:1"], resolver=dns)
        async with running(router):
            await eventually(lambda: up_addresses(router) == {d[0].address})
            dispatcher = Dispatcher(router, router._channels, max_retries=0)
            stream = dispatcher.stream(
                DecodeJob("r", [1], SamplingParams(max_tokens=10)), timeout=10
            )
            first = await anext(stream)
            dns.answers["decode"] = [d[1].address]  # scaled in: d0's pod left the answer
            await eventually(lambda: up_addresses(router) == {d[1].address})
            gone = next(w for w in router.workers if w.address == d[0].address)
            assert gone.left and gone.in_flight == 1
            assert d[0].address in router._channels  # its stream still uses the channel
            rest = [out async for out in stream]
            await eventually(lambda: d[0].address not in {w.address for w in router.workers})
            await eventually(lambda: d[0].address not in router._channels)
    tokens = [t for out in (first, *rest) for t in out.new_token_ids]
    assert tokens == list(range(100, 110))


async def test_a_missed_poll_is_tolerated_until_down_after_s() -> None:
    prefill = FakePrefillWorker()
    async with fake_workers([FakeDecodeWorker()], [prefill]) as (d, p):
        router = make_router([d[0].address], [p[0].address], down_after_s=1.0)
        async with running(router):
            await eventually(lambda: up_addresses(router, WorkerKind.PREFILL) == {p[0].address})
            prefill.stats_error = errors.DeadlineExceededError("engine busy")
            await asyncio.sleep(0.4)  # several missed polls, less than down_after_s
            assert up_addresses(router, WorkerKind.PREFILL) == {p[0].address}
            assert router.pick(5).prefill == p[0].address
            await eventually(lambda: not up_addresses(router, WorkerKind.PREFILL), timeout=3.0)
            with pytest.raises(errors.UnavailableError, match=r"none has answered as serving for"):
                await router.route(5)
            prefill.stats_error = None
            await eventually(lambda: up_addresses(router, WorkerKind.PREFILL) == {p[0].address})


async def test_a_request_waits_briefly_for_a_worker_to_come_up() -> None:
    decode = FakeDecodeWorker()
    decode.stats_error = errors.UnavailableError("still loading weights")
    async with fake_workers([decode]) as (d, _):
        router = make_router([d[0].address], wait_for_worker_s=5.0)
        async with running(router):
            waiting = asyncio.create_task(router.route(1, timeout=10.0))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            decode.stats_error = None
            assert (await asyncio.wait_for(waiting, 5.0)).decode == d[0].address
        fast = make_router([d[0].address], wait_for_worker_s=5.0)
        decode.stats_error = errors.UnavailableError("gone")
        async with running(fast):
            began = asyncio.get_running_loop().time()
            with pytest.raises(
                errors.UnavailableError, match="none has answered since the gateway"
            ):
                await fast.route(1, timeout=0.3)  # the request's deadline bounds the wait
            assert asyncio.get_running_loop().time() - began < 2.0


async def test_a_name_with_no_address_says_so() -> None:
    async with running(make_router(["dns:///nothing-here:1"], resolver=FakeDNS())) as router:
        with pytest.raises(errors.UnavailableError, match="resolve.* to no address"):
            await router.route(1)


def test_same_host_pairing_keeps_prefill_and_decode_in_one_pod() -> None:
    router = make_router(
        ["10.0.0.1:50053", "10.0.0.2:50053"],
        ["10.0.0.1:50052", "10.0.0.2:50052"],
        same_host_prefill=True,
    )
    stats = {
        "10.0.0.1:50053": worker_pb2.WorkerStats(free_kv_blocks=10),
        "10.0.0.2:50053": worker_pb2.WorkerStats(free_kv_blocks=90),
        "10.0.0.1:50052": worker_pb2.WorkerStats(),
        "10.0.0.2:50052": worker_pb2.WorkerStats(queued_prompt_tokens=9000),
    }
    for worker in router.workers:
        worker.update(stats[worker.address])
    # The roomiest decode wins even though its pod's prefill is the busier one.
    assert router.pick(1) == Route(decode="10.0.0.2:50053", prefill="10.0.0.2:50052")
    next(w for w in router.workers if w.address == "10.0.0.2:50052").serving = False
    assert router.pick(1) == Route(decode="10.0.0.1:50053", prefill="10.0.0.1:50052")


async def test_health_check_answers_not_serving_while_starting(unused_tcp_port: int) -> None:
    """The router's NOT_SERVING test is the real grpc.health.v1 of an RpcServer."""
    gate = asyncio.Event()

    async def ready() -> None:
        await gate.wait()

    server = RpcServer(
        ServerSpec(
            name="starting",
            register=lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
                FakeDecodeWorker(), s
            ),
            service_names=(DECODE_SERVICE,),
            port=unused_tcp_port,
            ready=ready,
            grace_s=0,
        )
    )
    await server.start()
    try:
        router = make_router([f"127.0.0.1:{unused_tcp_port}"])
        async with running(router):
            await eventually(lambda: "NOT_SERVING" in router.workers[0].last_error)
            assert not router.workers[0].up
            gate.set()
            await eventually(lambda: router.workers[0].up)
    finally:
        await server.stop()


@pytest.fixture
def unused_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_worker_that_streams_is_up_while_its_stats_are_late() -> None:
    """A decode worker too busy to answer Stats in time but still streaming tokens stays
    routable (so requests moved off a dead worker have somewhere to go); once its streams
    stop too, it goes down after down_after_s as any silent worker does."""
    busy = FakeDecodeWorker()
    busy.script = Script(token_ids=list(range(40)), delay_s=0.05)  # a 2 s stream
    async with fake_workers([busy]) as (d, _):
        router = make_router([d[0].address], down_after_s=0.6)
        async with running(router):
            await eventually(lambda: up_addresses(router) == {d[0].address})
            dispatcher = Dispatcher(router, router._channels, max_retries=0)
            job = DecodeJob("r", [1], SamplingParams(max_tokens=40))
            stream = dispatcher.stream(job, timeout=10.0)
            first = await anext(stream)
            busy.stats_error = errors.DeadlineExceededError("engine busy")
            rest = []
            async for out in stream:  # 2 s of tokens: more than three times down_after_s
                rest.append(out)
                assert up_addresses(router) == {d[0].address}
            assert router.pick(1).decode == d[0].address
            await eventually(lambda: not up_addresses(router), timeout=3.0)
    assert [t for out in (first, *rest) for t in out.new_token_ids] == list(range(40))
