"""The open/closed state and in-flight count a server drains by.

Owns what the gRPC gate (``rpc.server``) and the gateway's HTTP gate
(``gateway.http.server``) share: a server admits work only while open, counts what it
admitted, and on shutdown closes with a reason and waits, bounded, for the count to
reach zero.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class DrainGate:
    def __init__(self, reason: str) -> None:
        """Starts closed, with ``reason`` as the refusal until ``open`` is set."""
        self.open = False
        self.reason = reason
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def close(self, reason: str) -> None:
        self.open = False
        self.reason = reason

    async def wait_idle(self, timeout: float) -> bool:
        """True when no counted call is in flight, False after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
