"""The decode side of the KV hand-off, driven without gRPC.

A real ``AsyncEngine`` (tiny model) whose KV pool is a real shm ``KVInbox``, and a
scripted ``PrefillLink`` that plays the prefill worker; where the data matters, a real
``ShmSender`` writes the blocks, so the checksum the handoff verifies is the real one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from decode_service.handoff import DecodeHandoff, HandoffLimits
from decode_service.kv_inbox import KVInbox
from decode_service.prefill_peers import PeerLimits, PrefillPeers
from engine.async_engine import AsyncEngine
from engine.errors import AbortedError, DeadlineExceededError, PermissionDeniedError
from engine.request import RequestOutput, RequestTimings
from engine.sampling_params import SamplingParams
from engine.transfer.base import SendJob, TransferConfig
from engine.transfer.factory import make_sender
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import (
    Ack,
    FirstToken,
    Phase,
    PrefillEvent,
    PrefillOrder,
    Progress,
    TransferDone,
    order_is_signed,
)
from rpc.tracing import CANCELLED, REQUEST_ID
from tests.engine_helpers import make_core

STALL_S = 0.4
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = list(range(500, 540))  # 3 blocks of 16
# Fast drain for the quarantine test: a stalled writer's blocks are reported after this.
RECEIVER = TransferConfig(stall_timeout_s=0.5)


class ScriptedLink:
    """Plays a prefill worker: ``on_order`` runs when the order arrives."""

    def __init__(self, on_order: Callable[[ScriptedLink, PrefillOrder], None]) -> None:
        self.events: asyncio.Queue[PrefillEvent | None] = asyncio.Queue()
        self.sent: list[PrefillOrder | Ack] = []
        self.cancelled = False
        self._on_order = on_order

    async def send(self, message: PrefillOrder | Ack) -> None:
        self.sent.append(message)
        if isinstance(message, PrefillOrder):
            self._on_order(self, message)

    async def receive(self) -> PrefillEvent | None:
        return await self.events.get()

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


class Rig:
    def __init__(self, engine: AsyncEngine, inbox: KVInbox) -> None:
        self.engine = engine
        self.inbox = inbox
        self.links: list[ScriptedLink] = []
        self.opened: list[tuple[str, float | None]] = []
        self.contexts: list[Context | None] = []  # the trace context each link carried
        self.script: Callable[[ScriptedLink, PrefillOrder], None] = lambda link, order: None
        layout = engine.core.layout
        gen = torch.Generator().manual_seed(0)
        self.source = torch.randn(layout.pool_shape(16), generator=gen).to(
            engine.core.runner.kv_cache.dtype
        )
        # One layer per group, so a sender can be frozen between groups.
        self.sender = make_sender("shm", self.source, layout, TransferConfig(group_bytes=1))

    def handoff(
        self,
        stall_s: float = STALL_S,
        fleet_key: FleetKey | None = None,
        tracer: Tracer | None = None,
        peers: PrefillPeers | None = None,
    ) -> DecodeHandoff:
        def open_link(
            address: str, remaining: float | None, trace_context: Context | None
        ) -> ScriptedLink:
            self.opened.append((address, remaining))
            self.contexts.append(trace_context)
            link = ScriptedLink(self.script)
            self.links.append(link)
            return link

        limits = HandoffLimits(stall_s)
        return DecodeHandoff(
            self.engine, self.inbox, limits, open_link, fleet_key, tracer, peers=peers
        )

    def transfer(
        self,
        link: ScriptedLink,
        order: PrefillOrder,
        *,
        sender: str = "s1",
        timings: RequestTimings | None = None,
    ) -> None:
        """Really write the blocks, then report FirstToken and TransferDone."""
        link.events.put_nowait(FirstToken(7, None, 0, sender))
        src = tuple(range(len(order.descriptor.block_ids)))
        self.sender.submit(SendJob(order.request_id, src, order.descriptor, time.monotonic() + 30))

        async def report() -> None:
            while not (done := self.sender.poll()):
                await asyncio.sleep(0.005)
            (completion,) = done
            if completion.ok:
                link.events.put_nowait(
                    TransferDone(
                        completion.checksum or 0,
                        completion.epoch,
                        completion.num_bytes,
                        timings=timings,
                    )
                )

        asyncio.get_running_loop().create_task(report())

    def all_free(self) -> bool:
        st = self.engine.stats()
        return st.num_free_blocks == st.num_total_blocks and st.num_waiting_for_kv == 0

    async def settle(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not self.all_free():
            assert time.monotonic() < end, f"blocks not back: {self.engine.stats()}"
            await asyncio.sleep(0.01)


@pytest_asyncio.fixture
async def rig(tiny_llama: Path) -> AsyncIterator[Rig]:
    inbox = KVInbox("shm", "", RECEIVER)
    inbox.bind(asyncio.get_running_loop())
    core = await asyncio.to_thread(
        make_core, tiny_llama, num_blocks=32, kv_pool_factory=inbox.allocate_pool
    )
    engine = AsyncEngine(core)
    await engine.start()
    r = Rig(engine, inbox)
    try:
        yield r
    finally:
        r.sender.close()
        await engine.shutdown()
        inbox.close()


async def _collect(outputs: AsyncIterator[RequestOutput]) -> list[int]:
    tokens: list[int] = []
    async for out in outputs:
        tokens.extend(out.new_token_ids)
    return tokens


async def test_a_correct_hand_off_decodes_and_acks(rig: Rig) -> None:
    rig.script = rig.transfer
    tokens = await _collect(rig.handoff().run("r1", PROMPT, PARAMS, "p:1", None))
    assert len(tokens) == PARAMS.max_tokens and tokens[0] == 7
    (link,) = rig.links
    assert isinstance(link.sent[0], PrefillOrder) and link.sent[1] == Ack(True, "")
    await rig.settle()


async def test_a_queued_reservation_waits_until_served_or_the_clients_deadline(
    rig: Rig,
) -> None:
    """A request that got a place in the reservation FIFO is never sent away after a timed
    wait of decode's own: it waits for blocks without a bound of its own, or up to the
    client's deadline."""
    asked: list[float | None] = []
    real_reserve = rig.engine.reserve

    async def reserve(rid, prompt, params, *, timeout_s=0.0):  # noqa: ANN001, ANN202
        asked.append(timeout_s)
        return await real_reserve(rid, prompt, params, timeout_s=timeout_s)

    rig.engine.reserve = reserve  # type: ignore[method-assign]
    rig.script = rig.transfer
    await _collect(rig.handoff().run("r1", PROMPT, PARAMS, "p:1", None))
    await _collect(rig.handoff().run("r2", PROMPT, PARAMS, "p:1", time.monotonic() + 120))
    assert asked[0] is None
    assert asked[1] is not None and 110 < asked[1] <= 120
    await rig.settle()


async def test_spans_and_first_output_timings_of_a_hand_off(rig: Rig) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    caller = trace.SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=trace.TraceFlags(1))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(caller))
    # Prefill's phases, and one it has no say in (decode's own reservation).
    reported = RequestTimings(queued_s=0.125, prefill_s=0.25, transfer_s=0.5, reserved_s=9.0)
    rig.script = lambda link, order: rig.transfer(link, order, timings=reported)
    handoff = rig.handoff(tracer=provider.get_tracer("test"))
    outs = [o async for o in handoff.run("t1", PROMPT, PARAMS, "p:1", None, trace_context=parent)]
    first = outs[0].timings
    assert first is not None and first.reserved_s is not None and 0 <= first.reserved_s < 5
    assert (first.queued_s, first.prefill_s, first.transfer_s) == (0.125, 0.25, 0.5)
    assert all(o.timings is None for o in outs[1:])  # the servicer stamps the rest
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"decode.reserve", "decode.wait_kv", "decode.decode"}
    for s in spans.values():
        assert s.parent is not None and s.parent.span_id == 0xDEF and s.context.trace_id == 0xABC
        assert s.attributes[REQUEST_ID] == "t1"
    # The prefill stream carried decode.wait_kv as its parent.
    (carried,) = rig.contexts
    assert trace.get_current_span(carried).get_span_context() == spans["decode.wait_kv"].context
    assert spans["decode.reserve"].end_time <= spans["decode.wait_kv"].start_time
    assert spans["decode.wait_kv"].end_time <= spans["decode.decode"].start_time
    await rig.settle()


async def test_a_failed_hand_off_is_an_error_span(rig: Rig) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rig.script = lambda link, order: link.events.put_nowait(None)  # prefill hangs up
    with pytest.raises(AbortedError):
        await _collect(
            rig.handoff(tracer=provider.get_tracer("test")).run("t2", PROMPT, PARAMS, "p:1", None)
        )
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"decode.reserve", "decode.wait_kv"}
    assert spans["decode.wait_kv"].status.status_code is trace.StatusCode.ERROR
    await rig.settle()


async def test_a_cancelled_stream_is_no_error_span(rig: Rig) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rig.script = rig.transfer
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    handoff = rig.handoff(tracer=provider.get_tracer("test"))
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in handoff.run("t3", PROMPT, long, "p:1", None):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 10)
    task.cancel()  # the gateway went away mid-stream
    with pytest.raises(asyncio.CancelledError):
        await task
    spans = {s.name: s for s in exporter.get_finished_spans()}
    decode = spans["decode.decode"]
    assert decode.attributes[CANCELLED] is True
    assert decode.status.status_code is trace.StatusCode.UNSET
    await rig.settle()


async def test_progress_beats_outlive_the_stall_bound(rig: Rig) -> None:
    def slow(link: ScriptedLink, order: PrefillOrder) -> None:
        async def beats() -> None:
            for i in range(8):  # 1.2 s of beats: three stall bounds
                await asyncio.sleep(STALL_S * 0.4)
                link.events.put_nowait(Progress(Phase.PREFILLING, 4 * i))
            rig.transfer(link, order)

        asyncio.get_running_loop().create_task(beats())

    rig.script = slow
    began = time.monotonic()
    tokens = await _collect(rig.handoff().run("r2", PROMPT, PARAMS, "p:1", None))
    assert len(tokens) == PARAMS.max_tokens
    assert time.monotonic() - began > 2.5 * STALL_S
    await rig.settle()


async def test_a_silent_prefill_is_aborted_at_the_stall_bound(rig: Rig) -> None:
    began = time.monotonic()
    with pytest.raises(AbortedError, match="no progress"):
        await _collect(rig.handoff().run("r3", PROMPT, PARAMS, "p:1", None))
    assert STALL_S * 0.9 < time.monotonic() - began < STALL_S + 1.0
    assert rig.links[0].cancelled
    await rig.settle()


async def test_the_clients_deadline_is_deadline_exceeded(rig: Rig) -> None:
    handoff = rig.handoff(stall_s=5.0)
    with pytest.raises(DeadlineExceededError, match="client's deadline"):
        await _collect(handoff.run("r4", PROMPT, PARAMS, "p:1", time.monotonic() + 0.3))
    await rig.settle()


async def test_time_left_is_taken_when_prefill_is_called(rig: Rig) -> None:
    """The deadline passed to prefill counts the wait for KV blocks."""
    real_reserve = rig.engine.reserve

    async def slow_reserve(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        await asyncio.sleep(0.5)
        return await real_reserve(*args, **kwargs)

    rig.engine.reserve = slow_reserve  # type: ignore[method-assign]
    rig.script = rig.transfer
    deadline = time.monotonic() + 10.0
    await _collect(rig.handoff().run("r5", PROMPT, PARAMS, "p:1", deadline))
    (_, remaining) = rig.opened[0]
    assert remaining is not None and remaining <= 10.0 - 0.5
    await rig.settle()


async def test_a_restarted_prefill_sender_is_forgotten(rig: Rig) -> None:
    forgotten: list[str] = []
    rig.inbox.forget_sender = forgotten.append  # type: ignore[method-assign]
    handoff = rig.handoff()
    for rid, sender in (("a1", "old"), ("a2", "old"), ("a3", "new")):
        rig.script = lambda link, order, sender=sender: rig.transfer(link, order, sender=sender)
        await _collect(handoff.run(rid, PROMPT, PARAMS, "p:1", None))
    assert forgotten == ["old"]
    await rig.settle()


async def test_a_prefill_sender_on_a_new_address_drops_the_old_address(rig: Rig) -> None:
    """Hand-offs are counted by address and report their sender: the same sender reached
    at a new address leaves the old address's channel to be dropped (not the sender);
    a failed hand-off is counted out too."""
    forgotten: list[str] = []
    dropped: list[str] = []
    clock = [0.0]
    limits = PeerLimits(idle_s=100.0, departed_idle_s=10.0)
    peers = PrefillPeers(
        forgotten.append, drop_channel=dropped.append, limits=limits, clock=lambda: clock[0]
    )
    handoff = rig.handoff(peers=peers)
    for rid, address in (("m1", "10.0.0.1:5"), ("m2", "10.0.0.9:5")):
        rig.script = rig.transfer
        await _collect(handoff.run(rid, PROMPT, PARAMS, address, None))
    assert peers.address_of("s1") == "10.0.0.9:5"
    assert (dropped, forgotten) == (["10.0.0.1:5"], [])
    rig.script = lambda link, order: link.events.put_nowait(None)  # ends without a token
    with pytest.raises(AbortedError):
        await _collect(handoff.run("m3", PROMPT, PARAMS, "10.0.0.9:5", None))
    clock[0] += limits.idle_s + 1
    assert peers.prune() == ["10.0.0.9:5"]  # no stream left open on it: idle, dropped
    assert forgotten == ["s1"]
    await rig.settle()


async def test_a_frozen_writer_keeps_its_blocks_quarantined(rig: Rig) -> None:
    """The request ends at once with a typed status, but its blocks go back to the engine
    only once the frozen sender has let go: never while its claim stands."""
    frozen, go = threading.Event(), threading.Event()

    def freeze(request_id: str, group: int) -> None:
        if group == 1:
            frozen.set()
            go.wait(30)

    rig.sender._on_group = freeze  # type: ignore[attr-defined]
    rig.script = rig.transfer
    try:
        with pytest.raises(AbortedError):
            await _collect(rig.handoff().run("r6", PROMPT, PARAMS, "p:1", None))
        assert frozen.is_set()
        await asyncio.sleep(RECEIVER.drain_s + 0.3)
        assert rig.inbox.num_quarantined == 1
        stats = rig.engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks - 3, stats  # still held
        go.set()
        await rig.settle()
        assert rig.inbox.num_quarantined == 0
    finally:
        go.set()


async def test_with_a_fleet_secret_orders_are_signed_and_unsigned_transfers_refused(
    rig: Rig,
) -> None:
    key = FleetKey(b"fleet-secret-0123456789")
    rig.script = rig.transfer  # a prefill worker without the secret: its TransferDone is bare
    with pytest.raises(PermissionDeniedError, match="without the fleet's secret"):
        await _collect(rig.handoff(fleet_key=key).run("f1", PROMPT, PARAMS, "p:1", None))
    (link,) = rig.links
    order = link.sent[0]
    assert isinstance(order, PrefillOrder) and order_is_signed(key, order)
    assert all(not isinstance(m, Ack) or not m.ok for m in link.sent[1:]), "never acked"
    await rig.settle()
