"""Reservations on the real engine thread: a request the pool cannot take waits in the
scheduler's FIFO and is granted by the engine thread when blocks free up (one engine
command per request, never a poll), within its timeout, or refused at once when the FIFO
is full."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.errors import ResourceExhaustedError
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
BIG = list(range(1000, 1900))  # 57 blocks of the 128


@pytest.fixture
async def engine(tiny_llama: Path):
    eng = AsyncEngine(make_core(tiny_llama, num_blocks=128, max_queued_requests=2))
    await eng.start()
    yield eng
    await eng.shutdown()


def _count_calls(engine: AsyncEngine) -> list[str]:
    calls: list[str] = []
    sched = engine.core.scheduler
    real = sched.queue_remote

    def counted(req):  # noqa: ANN001, ANN202
        calls.append(req.request_id)
        return real(req)

    sched.queue_remote = counted  # type: ignore[method-assign]
    return calls


async def _settled(engine: AsyncEngine) -> None:
    for _ in range(200):
        st = engine.stats()
        if st.num_free_blocks == st.num_total_blocks and st.num_waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not settled: {engine.stats()}")


async def test_a_queued_reservation_is_granted_when_blocks_free_up(engine: AsyncEngine) -> None:
    calls = _count_calls(engine)
    leases = [await engine.reserve(f"big{i}", BIG, GREEDY, timeout_s=5) for i in range(2)]
    waiter = asyncio.create_task(engine.reserve("late", BIG, GREEDY, timeout_s=30))
    await asyncio.sleep(0.5)
    assert not waiter.done()
    assert engine.stats().num_waiting == 1  # queued for blocks, as Stats reports it
    freed = time.monotonic()
    engine.abort("big0")
    lease, _ = await asyncio.wait_for(waiter, 5)
    assert time.monotonic() - freed < 1.0
    assert len(lease.block_ids) == 57
    assert calls == ["big0", "big1", "late"], "one engine command per request: no polling"
    for rid in ("big1", "late"):
        engine.abort(rid)
    del leases
    await _settled(engine)


async def test_a_reservation_that_waits_too_long_is_resource_exhausted(
    engine: AsyncEngine,
) -> None:
    for i in range(2):
        await engine.reserve(f"big{i}", BIG, GREEDY, timeout_s=5)
    began = time.monotonic()
    with pytest.raises(ResourceExhaustedError, match="no KV blocks within"):
        await engine.reserve("late", BIG, GREEDY, timeout_s=0.5)
    assert 0.45 < time.monotonic() - began < 2.0
    for _ in range(100):  # the queue entry went with the caller
        if engine.stats().num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_waiting == 0
    # Blocks freed afterwards are not granted to the caller that gave up.
    engine.abort("big0")
    engine.abort("big1")
    await _settled(engine)


async def test_a_full_reservation_queue_refuses_at_once(engine: AsyncEngine) -> None:
    for i in range(2):
        await engine.reserve(f"big{i}", BIG, GREEDY, timeout_s=5)
    waiters = [
        asyncio.create_task(engine.reserve(f"q{i}", BIG, GREEDY, timeout_s=30)) for i in range(2)
    ]
    await asyncio.sleep(0.3)
    began = time.monotonic()
    with pytest.raises(ResourceExhaustedError, match="reservation queue is full"):
        await engine.reserve("over", BIG, GREEDY, timeout_s=30)
    assert time.monotonic() - began < 1.0
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    engine.abort("big0")
    engine.abort("big1")
    await _settled(engine)
