"""The asyncio face when things go wrong: a command that raises, an engine thread that
dies, one stuck in a step (the stall ``rpc.liveness`` reports), and load read while the
engine is busy."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.errors import InternalError, UnavailableError
from engine.sampling_params import SamplingParams
from rpc.liveness import EngineStall
from tests.engine_helpers import make_core

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def _drain(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    out: list[int] = []
    async for o in engine.generate(rid, prompt, GREEDY):
        out.extend(o.new_token_ids)
    return out


async def _wait_all_free(engine: AsyncEngine) -> None:
    for _ in range(200):
        st = engine.stats()
        if st.num_free_blocks == st.num_total_blocks and st.num_running + st.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"blocks not freed: {engine.stats()}")


async def test_a_failing_command_ends_its_stream_with_internal(tiny_llama: Path) -> None:
    engine = AsyncEngine(make_core(tiny_llama, num_blocks=64))
    await engine.start()
    try:
        real_add = engine.core.add_request

        def add(req):  # noqa: ANN001, ANN202
            if req.request_id == "doomed":
                raise RuntimeError("scheduler rejected the request (injected)")
            return real_add(req)

        engine.core.add_request = add  # type: ignore[method-assign]
        healthy = asyncio.create_task(_drain(engine, "fine", list(range(100, 140))))
        with pytest.raises(InternalError, match="engine command add failed.*injected"):
            await asyncio.wait_for(_drain(engine, "doomed", list(range(200, 230))), 10)
        assert len(await asyncio.wait_for(healthy, 60)) == GREEDY.max_tokens
        await _wait_all_free(engine)
    finally:
        await engine.shutdown()


async def test_a_failing_kv_ready_ends_the_stream_and_frees_the_lease(tiny_llama: Path) -> None:
    engine = AsyncEngine(make_core(tiny_llama, num_blocks=64))
    await engine.start()
    try:

        def broken(request_id: str, first_token: int):  # noqa: ANN202
            raise KeyError("injected")

        engine.core.scheduler.remote_kv_ready = broken  # type: ignore[method-assign]
        _, stream = await engine.reserve("r", list(range(50, 90)), GREEDY)
        engine.kv_ready("r", 7)
        with pytest.raises(InternalError, match="kv_ready"):
            async for _ in stream:
                pass
        await _wait_all_free(engine)
    finally:
        await engine.shutdown()


async def test_engine_death_ends_every_stream_and_reports_it(tiny_llama: Path) -> None:
    deaths: list[BaseException] = []
    engine = AsyncEngine(make_core(tiny_llama, num_blocks=64), on_death=deaths.append)
    await engine.start()
    try:
        started = threading.Event()

        def explode(sched):  # noqa: ANN001, ANN202
            started.set()
            raise MemoryError("forward failed (injected)")

        engine.core.runner._run = explode  # type: ignore[method-assign]
        streams = [
            asyncio.create_task(_drain(engine, f"r{i}", list(range(10 * i + 3, 10 * i + 30))))
            for i in range(4)
        ]
        began = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 10)
        assert all(isinstance(r, UnavailableError) for r in results), results
        assert time.monotonic() - began < 5
        assert len(deaths) == 1 and "injected" in repr(deaths[0])
        assert not engine.alive
        with pytest.raises(UnavailableError, match="engine thread died"):
            await _drain(engine, "late", [1, 2, 3])
    finally:
        await engine.shutdown()


async def test_a_reserve_still_queued_when_the_engine_dies_fails_unavailable(
    tiny_llama: Path,
) -> None:
    """A reserve whose command is still queued behind a step when the engine thread dies
    never runs; its caller, waiting without a bound, gets UNAVAILABLE, not a hang."""
    engine = AsyncEngine(make_core(tiny_llama, num_blocks=64))
    await engine.start()
    entered, release = threading.Event(), threading.Event()

    def stuck_then_dead(sched):  # noqa: ANN001, ANN202
        entered.set()
        release.wait(30)
        raise MemoryError("forward failed (injected)")

    engine.core.runner._run = stuck_then_dead  # type: ignore[method-assign]
    running = asyncio.create_task(_drain(engine, "running", list(range(300, 340))))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        # The engine thread is inside the step: this reserve's command waits in the queue.
        queued = asyncio.create_task(
            engine.reserve("queued", list(range(50, 90)), GREEDY, timeout_s=None)
        )
        await asyncio.sleep(0.2)
        assert not queued.done()
        release.set()
        with pytest.raises(UnavailableError, match="engine thread died"):
            await asyncio.wait_for(queued, 5)
        with pytest.raises(UnavailableError):
            await asyncio.wait_for(running, 5)
    finally:
        release.set()
        await engine.shutdown()


async def test_stats_answer_at_once_while_a_step_computes(tiny_llama: Path) -> None:
    engine = AsyncEngine(make_core(tiny_llama, num_blocks=64))
    await engine.start()
    release = threading.Event()
    entered = threading.Event()
    real_execute = engine.core.runner._run

    def slow(sched):  # noqa: ANN001, ANN202
        entered.set()
        release.wait(30)  # a long forward
        return real_execute(sched)

    engine.core.runner._run = slow  # type: ignore[method-assign]
    task = asyncio.create_task(_drain(engine, "long", list(range(300, 360))))
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        await asyncio.sleep(0.1)
        began = time.monotonic()
        stats = engine.stats()
        assert time.monotonic() - began < 0.5  # the forward holds for 30 s: not behind it
        assert stats.num_running == 1 and stats.num_free_blocks < stats.num_total_blocks
    finally:
        release.set()
        await asyncio.wait_for(task, 60)
        await engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
async def test_a_step_that_blocks_stalls_the_engine_until_it_steps_again(
    tiny_llama: Path, overlap: bool
) -> None:
    """An engine thread stuck in a step is alive but wedged: its snapshot ages past the
    bound, and the stall clears as soon as it steps again."""
    engine = AsyncEngine(make_core(tiny_llama, num_blocks=64), overlap=overlap)
    stall = EngineStall(0.5, lambda: engine.snapshot_age_s)
    await engine.start()
    release = threading.Event()
    entered = threading.Event()
    real_execute = engine.core.runner._run

    def wedged(sched):  # noqa: ANN001, ANN202
        if not release.is_set():
            entered.set()
            release.wait(30)  # stuck in the step, not dead
        return real_execute(sched)

    try:
        await asyncio.sleep(0.8)  # idle: the engine still publishes every half second
        assert stall.check() is None
        engine.core.runner._run = wedged  # type: ignore[method-assign]
        task = asyncio.create_task(_drain(engine, "stuck", list(range(300, 340))))
        assert await asyncio.to_thread(entered.wait, 10)
        for _ in range(100):
            if stall.check() is not None:
                break
            await asyncio.sleep(0.05)
        reason = stall.check()
        assert reason is not None and "has not finished a step" in reason
        assert engine.alive
        release.set()
        assert len(await asyncio.wait_for(task, 60)) == GREEDY.max_tokens
        assert stall.check() is None
    finally:
        release.set()
        await engine.shutdown()
