"""The prefill workers a decode worker hands off with, keyed by their sender incarnation.

Per prefill address: the KV sender incarnation last seen there, the hand-off streams open
to it and when it was last used. Per incarnation: the address it was last seen at. What a
peer leaves behind here (a gRPC channel to its address; its connections on the KV
receiver, such as gloo pairs) is dropped once it is no longer needed:

- **a restart at the same address** (a new incarnation there): the old incarnation's
  connections are forgotten at once;
- **a move** (the same incarnation seen at a new address): the old address's channel and
  entry are dropped as soon as no stream uses them; the sender's connections stay;
- **a departure** (the address left the ``--prefill-allow`` DNS answer, as a pod that
  drains or is replaced does): dropped ``departed_idle_s`` after its last stream;
- **idleness** (the gateway stopped naming it, whatever the reason): dropped ``idle_s``
  after its last stream.

An incarnation whose last address is dropped is forgotten on the receiver. ``idle_s`` is
longer than the sender's own idle bound (``TransferConfig.peer_idle_s``, after which a live
sender drops its cached connection and opens a new one), so forgetting an idle sender
never cuts a connection it still uses. An address with a stream open is never dropped.

Pruning runs whenever a hand-off starts, reports its sender or ends: it needs no timer,
and a worker without traffic keeps what it has (the receiver reaps idle connections on
its own, later). Owned by one event loop; nothing here blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerLimits:
    # An address no stream has used for this long is dropped. Longer than the sender's own
    # idle bound (TransferConfig.peer_idle_s, 300 s) plus its reaping period, so a live
    # sender has already let go of its connection here when we forget it.
    idle_s: float = 360.0
    # An address that left the fleet's DNS answer is dropped this long after its last
    # stream: the gateway stops routing to a draining worker at once, so this only lets
    # stragglers (a retry already on its way) finish.
    departed_idle_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("idle_s", "departed_idle_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PeerLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class _Address:
    """One prefill address this worker has dialled."""

    incarnation: str = ""  # the sender last seen there; "" until its first report
    in_flight: int = 0  # hand-off streams open to it
    last_used: float = 0.0  # clock() when a stream to it last began or ended


class PrefillPeers:
    """``forget_sender`` drops an incarnation's connections on the KV receiver;
    ``drop_channel`` forgets an address's channel and closes it in the background
    (``ChannelCache.discard``); ``departed`` says whether an address left the fleet's
    discovery (``PrefillFleet.departed``). None of them may block. ``begin``/``end``
    bracket every hand-off stream."""

    def __init__(
        self,
        forget_sender: Callable[[str], None],
        *,
        drop_channel: Callable[[str], None] = lambda address: None,
        departed: Callable[[str], bool] = lambda address: False,
        limits: PeerLimits = PeerLimits(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._forget_sender = forget_sender
        self._drop_channel = drop_channel
        self._departed = departed
        self._limits = limits
        self._clock = clock
        self._addresses: dict[str, _Address] = {}
        # sender incarnation -> the address it was last seen at.
        self._where: dict[str, str] = {}

    def __contains__(self, address: str) -> bool:
        return address in self._addresses

    def sender_at(self, address: str) -> str | None:
        """The incarnation last seen at ``address``; None when unknown or not yet seen."""
        entry = self._addresses.get(address)
        return (entry.incarnation or None) if entry is not None else None

    def address_of(self, incarnation: str) -> str | None:
        """Where ``incarnation`` was last seen; None once it is forgotten."""
        return self._where.get(incarnation)

    def begin(self, address: str) -> None:
        """A hand-off stream to ``address`` opens: it is in use until ``end``."""
        entry = self._addresses.setdefault(address, _Address())
        entry.in_flight += 1
        entry.last_used = self._clock()
        self.prune()

    def end(self, address: str) -> None:
        """The stream ``begin`` counted has ended (call exactly once per ``begin``)."""
        entry = self._addresses.get(address)
        assert entry is not None and entry.in_flight > 0, f"end({address}) without begin"
        entry.in_flight -= 1
        entry.last_used = self._clock()
        self.prune()

    def note_sender(self, address: str, incarnation: str) -> None:
        """The prefill worker at ``address`` reported its KV sender ``incarnation``."""
        if not incarnation:
            return
        entry = self._addresses.setdefault(address, _Address(last_used=self._clock()))
        old = entry.incarnation
        if old and old != incarnation:
            logger.info(
                "prefill %s restarted (sender %s -> %s); dropping the old one's connections",
                address,
                old,
                incarnation,
            )
            if self._where.get(old) == address:  # not seen anywhere since: it is gone
                del self._where[old]
                self._forget_sender(old)
        moved_from = self._where.get(incarnation)
        if moved_from is not None and moved_from != address:
            logger.info(
                "prefill sender %s moved from %s to %s; dropping the old address once idle",
                incarnation,
                moved_from,
                address,
            )
        entry.incarnation = incarnation
        self._where[incarnation] = address
        self.prune()

    def prune(self) -> list[str]:
        """Drop every address that is no longer needed (see the module doc); returns them."""
        now = self._clock()
        dropped = []
        for address, entry in list(self._addresses.items()):
            if entry.in_flight:
                continue
            idle = now - entry.last_used
            moved = bool(entry.incarnation) and self._where.get(entry.incarnation) != address
            if moved:
                why = "its sender moved"
            elif idle > self._limits.idle_s:
                why = f"idle {idle:.0f} s"
            elif idle > self._limits.departed_idle_s and self._departed(address):
                why = f"left the fleet's DNS answer, idle {idle:.0f} s"
            else:
                continue
            self._drop(address, entry, why)
            dropped.append(address)
        return dropped

    def _drop(self, address: str, entry: _Address, why: str) -> None:
        del self._addresses[address]
        sender = entry.incarnation
        forget = bool(sender) and self._where.get(sender) == address
        logger.info(
            "prefill %s: dropping its channel (%s)%s",
            address,
            why,
            f" and sender {sender}'s connections" if forget else "",
        )
        if forget:
            del self._where[sender]
            self._forget_sender(sender)
        self._drop_channel(address)
