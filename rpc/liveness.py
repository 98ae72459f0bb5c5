"""Whether a worker can serve right now, and what that does to a request in its hand-off.

Two kinds of fault take a worker out of service. A *fatal* one is for good: its engine
thread or its KV receiver's thread died (the servicer's ``fatal`` future resolves, with
the reason). A *stall* may pass: the engine thread is alive but stuck in a step.
:class:`EngineStall` is that decision, read from how old the engine's stats snapshot is
(``AsyncEngine.snapshot_age_s``): the engine thread publishes one after every step and
at least every half second while idle, so only a step that runs longer than the bound
(or an engine thread stuck outside a step) lets it grow past it. ``rpc.server`` polls it
(``ServerSpec.liveness``) and turns health NOT_SERVING while it names a reason, SERVING
again once the engine steps.

:func:`unless_fatal` ends a request still waiting for its first output (the KV hand-off,
which may wait on a prefill peer for a whole stall bound) with UnavailableError the
moment the worker's fault is fatal, so the caller retries it elsewhere now.

No gRPC here: the services wire these in; tests drive them directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from engine.errors import UnavailableError

T = TypeVar("T")


class EngineStall:
    """``check()``: why the engine cannot serve now (its snapshot is older than
    ``bound_s``), or None when it can, or when there is no engine yet (``age`` answers
    None: readiness covers start-up). ``bound_s`` 0: never stalled."""

    def __init__(self, bound_s: float, age: Callable[[], float | None]) -> None:
        if bound_s < 0:
            raise ValueError(f"engine stall bound must be >= 0 seconds, got {bound_s!r}")
        self.bound_s = bound_s
        self._age = age

    def check(self) -> str | None:
        if self.bound_s == 0:
            return None
        age = self._age()
        if age is None or age <= self.bound_s:
            return None
        return (
            f"the engine has not finished a step for {age:.1f} s "
            f"(bound {self.bound_s:g} s, --engine-stall-timeout-s)"
        )


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
