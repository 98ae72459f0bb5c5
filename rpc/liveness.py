"""What a worker that can no longer serve does to a request in its hand-off.

A *fatal* fault takes a worker out of service for good: its engine thread or its KV
receiver's thread died (the servicer's ``fatal`` future resolves, with the reason).
:func:`unless_fatal` ends a request still waiting for its first output (the KV hand-off,
which may wait on a prefill peer for a whole stall bound) with UnavailableError the
moment the worker's fault is fatal, so the caller retries it elsewhere now.

No gRPC here: the services wire these in; tests drive them directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from engine.errors import UnavailableError

T = TypeVar("T")


async def unless_fatal(outputs: AsyncIterator[T], fatal: asyncio.Future[str]) -> AsyncIterator[T]:
    """``outputs``, except that while the first one is awaited, ``fatal`` resolving (with
    its reason) ends the stream with UnavailableError and closes ``outputs``, which frees
    what the request holds. Later outputs come from the engine, whose death ends its
    streams itself. ``outputs`` is closed however this ends."""
    async with contextlib.aclosing(outputs):
        first: asyncio.Future[T] = asyncio.ensure_future(anext(outputs))
        try:
            await asyncio.wait((first, fatal), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not first.done():
                # Unwinds the request (its finally blocks run) before ``aclosing`` closes it.
                first.cancel()
                await asyncio.wait((first,))
        if first.cancelled():
            raise UnavailableError(f"this worker cannot serve any more: {fatal.result()}")
        try:
            item = first.result()
        except StopAsyncIteration:
            return
        yield item
        async for item in outputs:
            yield item
