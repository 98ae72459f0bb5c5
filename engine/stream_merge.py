"""Several async streams read as one: each item as it comes, tagged with its stream's key.

A request's ``n`` choices run as separate sequences, on the decode worker that fans them
out (``decode_service.choices``) and in the gateway when they move to other workers
(``gateway.routing.choice_moves``); both hand their caller one stream. Each stream is
pumped by its own task into one queue, so a slow choice never holds back a fast one.
An error in any stream ends the merge with that error; leaving the merge (or its end)
closes every stream still open.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")

_END = object()


class StreamMerge(Generic[T]):
    """Streams added with ``add`` (before or while ``items`` runs), read by ``items``."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._open = 0

    def add(self, key: int, stream: AsyncIterator[T]) -> None:
        """Start reading ``stream``; its items come out of ``items`` tagged ``key``."""
        self._open += 1
        self._tasks.append(asyncio.create_task(self._pump(key, stream)))

    async def _pump(self, key: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    await self._queue.put((key, item))
        except BaseException as exc:  # handed to the reader, which raises it
            await self._queue.put((key, exc))
            return
        await self._queue.put((key, _END))

    async def items(self) -> AsyncGenerator[tuple[int, T], None]:
        """(key, item) pairs as they come, until every added stream ended; raises the
        first error any stream raised. Closing it cancels every stream's task."""
        try:
            while self._open:
                key, item = await self._queue.get()
                if item is _END:
                    self._open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield key, item  # type: ignore[misc]
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
