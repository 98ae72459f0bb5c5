"""rpc.liveness without gRPC: the engine-stall decision, and a request in its hand-off
ended with UNAVAILABLE the moment its worker's fault turns fatal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.errors import AbortedError, UnavailableError
from rpc.liveness import EngineStall, unless_fatal


def test_an_engine_is_stalled_only_past_the_bound() -> None:
    age: list[float | None] = [None]
    stall = EngineStall(60.0, lambda: age[0])
    assert stall.check() is None  # no engine yet: readiness covers start-up
    age[0] = 0.3
    assert stall.check() is None
    age[0] = 60.0
    assert stall.check() is None
    age[0] = 61.5
    reason = stall.check()
    assert reason is not None and "61.5 s" in reason and "--engine-stall-timeout-s" in reason
    age[0] = 0.01  # it stepped again
    assert stall.check() is None


def test_a_zero_bound_never_stalls_and_a_negative_one_is_refused() -> None:
    assert EngineStall(0.0, lambda: 1e9).check() is None
    with pytest.raises(ValueError, match="-1"):
        EngineStall(-1.0, lambda: 0.0)


class _Handoff:
    """A request's outputs: it waits for ``release`` before its first one, and records
    whether its cleanup ran."""

    def __init__(self, outputs: list[int], error: BaseException | None = None) -> None:
        self.release = asyncio.Event()
        self.outputs = outputs
        self.error = error
        self.cleaned_up = False

    async def run(self) -> AsyncIterator[int]:
        try:
            await self.release.wait()
            if self.error is not None:
                raise self.error
            for out in self.outputs:
                yield out
        finally:
            self.cleaned_up = True


async def test_a_fatal_fault_during_the_handoff_ends_it_unavailable_and_cleans_up() -> None:
    fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    handoff = _Handoff([1, 2])
    stream = unless_fatal(handoff.run(), fatal)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    assert not first.done()
    fatal.set_result("KV receiver thread died: OSError(24)")
    with pytest.raises(UnavailableError, match="KV receiver thread died"):
        await asyncio.wait_for(first, 5)
    assert handoff.cleaned_up


async def test_after_the_first_output_the_stream_is_left_alone() -> None:
    fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    handoff = _Handoff([1, 2, 3])
    handoff.release.set()
    stream = unless_fatal(handoff.run(), fatal)
    assert await anext(stream) == 1
    fatal.set_result("engine thread died")  # the engine ends its own streams
    assert [out async for out in stream] == [2, 3]
    assert handoff.cleaned_up


async def test_the_handoffs_own_outcome_passes_through() -> None:
    fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    failing = _Handoff([], AbortedError("checksum mismatch"))
    failing.release.set()
    with pytest.raises(AbortedError, match="checksum"):
        await anext(unless_fatal(failing.run(), fatal))
    empty = _Handoff([])
    empty.release.set()
    assert [out async for out in unless_fatal(empty.run(), fatal)] == []


async def test_a_caller_that_leaves_during_the_handoff_cleans_it_up() -> None:
    fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    handoff = _Handoff([1])

    async def consume() -> list[int]:
        return [out async for out in unless_fatal(handoff.run(), fatal)]

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert handoff.cleaned_up and not fatal.done()
