"""Decode's end of a Prefill stream under the fleet's secret: a ``PrefillLink`` that signs
the ack it sends and lets no event through whose tag does not check.

The hand-off (``decode_service.handoff``) signs the order itself; this link remembers it,
signs the ack for the order's request and lease (``message_tag``), and checks every
event the prefill worker sends, progress beats included, against the same lease before
the hand-off sees it: an event without the fleet's tag, or altered in any field after it
was signed, raises ``PermissionDeniedError``, so nothing is done with it (no lease is
extended, no sender forgotten, no KV verified or run).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from engine.errors import PermissionDeniedError
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import (
    Ack,
    PrefillEvent,
    PrefillOrder,
    message_is_signed,
    message_tag,
)

if TYPE_CHECKING:
    from decode_service.handoff import PrefillLink


class FleetLink:
    """Wraps ``link`` (a ``PrefillLink``) for a fleet whose secret is ``key``."""

    def __init__(self, link: PrefillLink, key: FleetKey, prefill: str) -> None:
        self._link = link
        self._key = key
        self._prefill = prefill  # for errors
        self._order: PrefillOrder | None = None

    async def send(self, message: PrefillOrder | Ack) -> None:
        if isinstance(message, PrefillOrder):
            self._order = message
        else:
            rid, lease = self._lease()
            message = dataclasses.replace(message, mac=message_tag(self._key, rid, lease, message))
        await self._link.send(message)

    async def receive(self) -> PrefillEvent | None:
        event = await self._link.receive()
        if event is None:
            return None
        rid, lease = self._lease()
        if not message_is_signed(self._key, rid, lease, event):
            raise PermissionDeniedError(
                f"request {rid}: prefill {self._prefill} sent a {type(event).__name__} without "
                "the fleet's secret (no tag, or one that does not match every field); its KV "
                "is not used"
            )
        return event

    async def done_writing(self) -> None:
        await self._link.done_writing()

    def cancel(self) -> None:
        self._link.cancel()

    def _lease(self) -> tuple[str, int]:
        """The request and lease of the order sent on this stream."""
        assert self._order is not None, "the order goes first on a Prefill stream"
        return self._order.request_id, self._order.descriptor.lease_token
