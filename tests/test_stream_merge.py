"""``engine.stream_merge.StreamMerge``: items as they come, tagged with their stream; a
slow stream never holds back a fast one; an error ends the merge with it; leaving the
merge early closes every stream; streams added while it runs are read too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from engine.stream_merge import StreamMerge


async def _ticks(name: str, n: int, delay: float, log: list[str]) -> AsyncIterator[str]:
    try:
        for i in range(n):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        log.append(f"{name} closed")


async def test_items_come_as_they_are_ready_each_tagged_with_its_stream() -> None:
    log: list[str] = []
    merge: StreamMerge[str] = StreamMerge()
    merge.add(0, _ticks("slow", 2, 0.2, log))
    merge.add(1, _ticks("fast", 3, 0.01, log))
    got = [pair async for pair in merge.items()]
    # All of the fast stream's items arrive before the slow one's first.
    assert got == [(1, "fast0"), (1, "fast1"), (1, "fast2"), (0, "slow0"), (0, "slow1")]
    assert sorted(log) == ["fast closed", "slow closed"]


async def test_an_error_in_one_stream_ends_the_merge_and_closes_the_others() -> None:
    log: list[str] = []

    async def broken() -> AsyncIterator[str]:
        yield "b0"
        raise RuntimeError("stream 1 broke")

    merge: StreamMerge[str] = StreamMerge()
    merge.add(0, _ticks("long", 1000, 0.01, log))
    merge.add(1, broken())
    seen: list[tuple[int, str]] = []
    with pytest.raises(RuntimeError, match="stream 1 broke"):
        async for pair in merge.items():
            seen.append(pair)
    assert (1, "b0") in seen
    assert log == ["long closed"]


async def test_leaving_early_closes_every_stream() -> None:
    log: list[str] = []
    merge: StreamMerge[str] = StreamMerge()
    for i in range(3):
        merge.add(i, _ticks(f"s{i}", 1000, 0.005, log))
    async with contextlib.aclosing(merge.items()) as items:
        async for _ in items:
            break
    assert sorted(log) == ["s0 closed", "s1 closed", "s2 closed"]


async def test_a_stream_added_while_reading_is_read_to_its_end() -> None:
    log: list[str] = []
    merge: StreamMerge[str] = StreamMerge()
    merge.add(0, _ticks("first", 2, 0.01, log))
    got: list[tuple[int, str]] = []
    async for key, item in merge.items():
        got.append((key, item))
        if item == "first0":
            merge.add(1, _ticks("later", 2, 0.05, log))
    assert got == [(0, "first0"), (0, "first1"), (1, "later0"), (1, "later1")]
