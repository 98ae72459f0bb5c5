"""The prefill side of the KV hand-off, driven without gRPC: a real ``AsyncEngine`` (tiny
model), a real shm ``KVOutbox`` and a real shm receiver standing in for decode."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from engine.async_engine import AsyncEngine
from engine.errors import AbortedError, LayoutMismatchError, PermissionDeniedError
from engine.sampling_params import SamplingParams
from engine.transfer.factory import make_receiver
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import (
    Ack,
    FirstToken,
    Phase,
    PrefillOrder,
    Progress,
    TransferDone,
    done_is_signed,
    message_tag,
    order_tag,
)
from prefill_service.handoff import PrefillHandoff, PrefillLimits
from prefill_service.kv_outbox import KVOutbox
from rpc.tracing import REQUEST_ID
from tests.engine_helpers import make_core

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = tuple(range(700, 780))  # 80 tokens: 5 blocks, 5 steps of 16 tokens
STEP_S = 0.05  # each engine step made this slow, so beats are seen


class Rig:
    def __init__(self, engine: AsyncEngine, outbox: KVOutbox, receiver) -> None:  # noqa: ANN001
        self.engine = engine
        self.outbox = outbox
        self.receiver = receiver

    def handoff(
        self, fleet_key: FleetKey | None = None, tracer: Tracer | None = None, **limits: float
    ) -> PrefillHandoff:
        values = {"stall_s": 2.0, "beat_s": STEP_S / 2, **limits}
        return PrefillHandoff(
            self.engine,
            self.outbox,
            self.engine.core.layout,
            PrefillLimits(**values),
            fleet_key,
            tracer,
        )

    def order(self, rid: str, prompt: tuple[int, ...] = PROMPT, blocks: int = 5) -> PrefillOrder:
        desc = self.receiver.expect(rid, tuple(range(1, blocks + 1)), 9, time.monotonic() + 30)
        return PrefillOrder(rid, prompt, PARAMS, desc)

    async def settle(self) -> None:
        end = time.monotonic() + 10
        while True:
            st = self.engine.stats()
            if st.num_free_blocks == st.num_total_blocks and st.num_held_blocks == 0:
                return
            assert time.monotonic() < end, f"prefill blocks not back: {st}"
            await asyncio.sleep(0.01)


@pytest_asyncio.fixture
async def rig(tiny_llama: Path) -> AsyncIterator[Rig]:
    core = await asyncio.to_thread(make_core, tiny_llama, num_blocks=32, max_num_batched_tokens=16)
    real = core.runner._run

    def slow(sched):  # noqa: ANN001, ANN202
        time.sleep(STEP_S)
        return real(sched)

    core.runner._run = slow  # type: ignore[method-assign]
    engine = AsyncEngine(core)
    await engine.start()
    loop = asyncio.get_running_loop()
    outbox = KVOutbox("shm", core.runner.kv_cache, core.layout, loop)
    receiver = make_receiver("shm", core.layout, 16)
    try:
        yield Rig(engine, outbox, receiver)
    finally:
        await asyncio.to_thread(outbox.close)
        await engine.shutdown()
        receiver.close()


async def _acks(*items: Ack | None) -> AsyncIterator[Ack | None]:
    for item in items:
        yield item


async def test_a_long_prefill_beats_then_hands_off(rig: Rig) -> None:
    events = [e async for e in rig.handoff().run(rig.order("p1"), _acks(Ack(True)), None)]
    beats = [e for e in events if isinstance(e, Progress)]
    kinds = [type(e).__name__ for e in events if not isinstance(e, Progress)]
    assert kinds == ["FirstToken", "TransferDone"]
    assert {b.phase for b in beats} >= {Phase.PREFILLING}
    computed = [b.num_computed_tokens for b in beats if b.phase is Phase.PREFILLING]
    assert computed == sorted(computed) and 0 < computed[-1] <= len(PROMPT)
    first = next(e for e in events if isinstance(e, FirstToken))
    assert first.sender_incarnation == rig.outbox.sender.incarnation
    done = next(e for e in events if isinstance(e, TransferDone))
    rig.receiver.verify("p1", done.checksum, done.epoch)
    await rig.settle()


def _in_memory() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


async def test_spans_and_timings_of_a_hand_off(rig: Rig) -> None:
    tracer, exporter = _in_memory()
    caller = trace.SpanContext(0x123, 0x456, is_remote=True, trace_flags=trace.TraceFlags(1))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(caller))
    handoff = rig.handoff(tracer=tracer)
    events = [
        e async for e in handoff.run(rig.order("s1"), _acks(Ack(True)), None, trace_context=parent)
    ]
    done = next(e for e in events if isinstance(e, TransferDone))
    timings = done.timings
    assert timings is not None
    assert timings.queued_s is not None and timings.queued_s >= 0
    # Five chunked steps of at least STEP_S each.
    assert timings.prefill_s is not None and timings.prefill_s >= 5 * STEP_S * 0.9
    assert timings.transfer_s is not None and timings.transfer_s >= 0
    assert (timings.reserved_s, timings.first_token_s, timings.decode_s) == (None, None, None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"prefill.queue", "prefill.prefill", "prefill.transfer"}
    for s in spans.values():
        assert s.parent is not None and s.parent.span_id == 0x456 and s.context.trace_id == 0x123
        assert s.attributes[REQUEST_ID] == "s1"
    assert spans["prefill.queue"].end_time == spans["prefill.prefill"].start_time
    assert spans["prefill.prefill"].end_time <= spans["prefill.transfer"].start_time
    rig.receiver.verify("s1", done.checksum, done.epoch)
    await rig.settle()


async def test_a_prefill_that_never_ran_is_one_failed_span(rig: Rig) -> None:
    tracer, exporter = _in_memory()
    handoff = rig.handoff(tracer=tracer)
    events = handoff.run(rig.order("s2"), _acks(Ack(True)), None)
    await anext(events)  # a progress beat: the request is in the engine
    await events.aclose()  # decode went away
    (span,) = exporter.get_finished_spans()
    assert span.name == "prefill.prefill" and span.status.status_code is trace.StatusCode.UNSET
    rig.receiver.cancel("s2")
    await rig.settle()


async def test_no_beat_when_nothing_moves(rig: Rig) -> None:
    """A beat says the worker made progress: an engine stuck in one forward sends none."""
    stuck, go = threading.Event(), threading.Event()
    real = rig.engine.core.runner._run

    def hang(sched):  # noqa: ANN001, ANN202
        stuck.set()
        go.wait(30)
        return real(sched)

    rig.engine.core.runner._run = hang  # type: ignore[method-assign]
    events = rig.handoff().run(rig.order("p2"), _acks(Ack(True)), None)
    seen: list[object] = []

    async def consume() -> None:
        async for e in events:
            seen.append(e)

    task = asyncio.create_task(consume())
    try:
        assert await asyncio.to_thread(stuck.wait, 10)
        await asyncio.sleep(10 * STEP_S)  # twenty beat periods
        assert [e for e in seen if isinstance(e, Progress)] == []
    finally:
        rig.engine.core.runner._run = real  # type: ignore[method-assign]
        go.set()
        await asyncio.wait_for(task, 20)
    await rig.settle()


async def test_decode_that_never_acks_frees_the_source_blocks(rig: Rig) -> None:
    with pytest.raises(AbortedError, match="without an ack"):
        async for _ in rig.handoff().run(rig.order("p3"), _acks(), None):
            pass
    await rig.settle()


async def test_a_refused_transfer_still_frees_the_source_blocks(rig: Rig) -> None:
    async for _ in rig.handoff().run(rig.order("p4"), _acks(Ack(False, "checksum")), None):
        pass
    await rig.settle()


async def test_orders_that_do_not_fit_are_refused_before_anything_runs(rig: Rig) -> None:
    order = rig.order("p5")
    other = dataclasses.replace(order.descriptor.endpoint.layout, block_size=32)
    bad = dataclasses.replace(
        order,
        descriptor=dataclasses.replace(
            order.descriptor, endpoint=dataclasses.replace(order.descriptor.endpoint, layout=other)
        ),
    )
    with pytest.raises(LayoutMismatchError, match="block_size"):
        async for _ in rig.handoff().run(bad, _acks(), None):
            pass
    # A decode worker in the other numerics mode (--deterministic) is refused the same way.
    mixed = dataclasses.replace(order.descriptor.endpoint.layout, deterministic=True)
    bad = dataclasses.replace(
        order,
        descriptor=dataclasses.replace(
            order.descriptor, endpoint=dataclasses.replace(order.descriptor.endpoint, layout=mixed)
        ),
    )
    with pytest.raises(LayoutMismatchError, match="deterministic: False != True"):
        async for _ in rig.handoff().run(bad, _acks(), None):
            pass
    rig.receiver.cancel("p5")
    await asyncio.sleep(0.1)
    rig.receiver.poll()
    with pytest.raises(ValueError, match="needs 5"):
        async for _ in rig.handoff().run(rig.order("p6", blocks=4), _acks(), None):
            pass
    await rig.settle()


async def test_an_order_over_a_prefix_decode_holds_sends_only_the_rest(rig: Rig) -> None:
    """first_block 2: decode's prefix cache holds the prompt's first two blocks, so the
    three leased blocks get prefill's blocks 2-4 (the checksum of what arrived matches
    the sender's over exactly those) and the bytes moved are three blocks'."""
    desc = rig.receiver.expect("f1", (7, 8, 9), 9, time.monotonic() + 30)
    order = PrefillOrder("f1", PROMPT, PARAMS, dataclasses.replace(desc, first_block=2))
    events = [e async for e in rig.handoff().run(order, _acks(Ack(True)), None)]
    done = next(e for e in events if isinstance(e, TransferDone))
    rig.receiver.verify("f1", done.checksum, done.epoch)
    assert done.num_bytes == 3 * rig.engine.core.layout.block_bytes
    await rig.settle()
    # The block of the prompt's last token is always sent: first_block 5 of 5 is refused,
    # and so is a block count that does not match what is left.
    for first, blocks, message in (
        (5, (11,), "first_block is 5; a 80-token prompt allows at most 4"),
        (2, (12, 13), "has 2 blocks; a 80-token prompt needs 3 from block 2 on"),
    ):
        rid = f"f{first}{len(blocks)}"
        bad = rig.receiver.expect(rid, blocks, 9, time.monotonic() + 30)
        order = PrefillOrder(rid, PROMPT, PARAMS, dataclasses.replace(bad, first_block=first))
        with pytest.raises(ValueError, match=message):
            async for _ in rig.handoff().run(order, _acks(), None):
                pass
        rig.receiver.cancel(rid)
    await rig.settle()


async def test_with_a_fleet_secret_only_signed_orders_run(rig: Rig) -> None:
    key = FleetKey(b"fleet-secret-0123456789")
    handoff = rig.handoff(key)
    unsigned = rig.order("s1")
    steps = rig.engine.stats().num_steps
    with pytest.raises(PermissionDeniedError, match="does not carry the fleet's secret"):
        async for _ in handoff.run(unsigned, _acks(), None):
            pass
    await asyncio.sleep(3 * STEP_S)
    assert rig.engine.stats().num_steps == steps, "a refused order must not run"
    rig.receiver.cancel("s1")
    await asyncio.sleep(0.1)
    rig.receiver.poll()
    order = rig.order("s2")
    signed = dataclasses.replace(order, mac=order_tag(key, order))
    ack = Ack(True)
    ack = dataclasses.replace(ack, mac=message_tag(key, "s2", order.descriptor.lease_token, ack))
    events = [e async for e in handoff.run(signed, _acks(ack), None)]
    done = next(e for e in events if isinstance(e, TransferDone))
    assert done_is_signed(key, "s2", order.descriptor.lease_token, done)
    await rig.settle()
