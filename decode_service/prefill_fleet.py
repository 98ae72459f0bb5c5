"""Which prefill workers a decode worker may dial: its fleet, and no one else.

A ``Decode`` call names the prefill worker to use (``prefill_address``), and decode hands
that worker a KV descriptor of its own pool. So a caller must not be able to point it at
an arbitrary address. The allow-list (``--prefill-allow``, repeated or comma-separated)
holds entries of three kinds:

- ``host:port``: exactly that address;
- ``host``: any port on that host;
- ``dns:///name:port``: the addresses ``name`` resolves to, at that port (a headless
  Service: every ready pod). Resolved again when an address is not found (at most once a
  second: a miss soon after a lookup waits for the next one rather than being refused),
  so new pods are accepted as the gateway discovers them. An address stays allowed for
  ``retain_s`` after it was last in an answer: a pod that starts draining leaves the
  answer at once, while the gateway may still route its last requests to it.

``departed`` tells the peers bookkeeping (``decode_service.prefill_peers``) which
addresses left the DNS answers, so what this worker holds for them can go early; it only
reads what the last lookups said.

The host of ``prefill_address`` is compared as written: a name is never resolved to
match an IP entry (what it resolves to when dialled could differ from what it resolved
to when checked). An empty list allows any address (no fleet configured). Anything else
is refused with PERMISSION_DENIED before a connection is made.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from engine.errors import PermissionDeniedError

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
# A miss re-resolves the DNS entries, but not more often than this.
RESOLVE_INTERVAL_S = 1.0
# How long an address stays allowed after it was last in a DNS answer (a draining pod
# leaves the answer before the gateway stops routing to it).
RETAIN_S = 120.0

# (name, port) -> the addresses it resolves to; raises OSError when the lookup fails.
Lookup = Callable[[str, int], Awaitable[list[str]]]


async def system_lookup(name: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True, slots=True)
class _DnsEntry:
    name: str
    port: int


class PrefillFleet:
    """The allow-list. ``check`` is the one question; it may resolve DNS entries."""

    def __init__(
        self,
        entries: Sequence[str],
        *,
        lookup: Lookup = system_lookup,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
        retain_s: float = RETAIN_S,
    ) -> None:
        self._hosts: set[str] = set()
        self._addresses: set[tuple[str, int]] = set()
        self._dns: list[_DnsEntry] = []
        for entry in entries:
            self._add(entry.strip())
        self._lookup = lookup
        self._resolve_interval_s = resolve_interval_s
        self._retain_s = retain_s
        # (host, port) -> when a DNS answer last held it (time.monotonic()).
        self._resolved: dict[tuple[str, int], float] = {}
        # Each DNS entry's last successful answer (a failed lookup keeps the one before).
        self._answers: dict[_DnsEntry, set[tuple[str, int]]] = {}
        self._resolved_at: float | None = None
        self._lock = asyncio.Lock()

    @property
    def open(self) -> bool:
        """True when no allow-list is configured: every address is accepted."""
        return not (self._hosts or self._addresses or self._dns)

    async def check(self, address: str) -> None:
        """Return if ``address`` (host:port) is in the fleet; raise PermissionDeniedError."""
        if self.open:
            return
        host, port = _split(address, "prefill_address")
        if host in self._hosts or (host, port) in self._addresses:
            return
        if self._dns:
            if self._known(host, port):
                return
            await self._refresh(host, port)
            if self._known(host, port):
                return
        raise PermissionDeniedError(
            f"prefill_address {address!r} is not a prefill worker of this decode worker's "
            "fleet (--prefill-allow)"
        )

    def departed(self, address: str) -> bool:
        """True when ``address`` is allowed only through DNS entries and no entry's last
        answer holds it any more (its pod drains, or was replaced). Addresses matched by a
        fixed entry, and any address of an open fleet, never depart. Looks nothing up."""
        if not self._dns:
            return False
        try:
            host, port = _split(address, "prefill_address")
        except ValueError:
            return False
        if host in self._hosts or (host, port) in self._addresses:
            return False
        return not any((host, port) in answer for answer in self._answers.values())

    def _known(self, host: str, port: int) -> bool:
        seen = self._resolved.get((host, port))
        return seen is not None and time.monotonic() - seen <= self._retain_s

    async def _refresh(self, host: str, port: int) -> None:
        """Look the DNS entries up again, unless another miss did while this one waited
        its turn; within ``resolve_interval_s`` of the last lookup, wait for the next."""
        async with self._lock:
            if self._known(host, port):
                return
            if self._resolved_at is not None:
                wait = self._resolved_at + self._resolve_interval_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            found = 0
            for entry in self._dns:
                try:
                    addresses = await self._lookup(entry.name, entry.port)
                except OSError as err:  # keep what earlier answers allowed
                    logger.warning("prefill fleet: cannot resolve %s: %s", entry.name, err)
                    continue
                now = time.monotonic()
                answer = {(address.strip("[]"), entry.port) for address in addresses}
                for key in answer:
                    self._resolved[key] = now
                self._answers[entry] = answer
                found += len(addresses)
            self._resolved_at = now = time.monotonic()
            for key, seen in list(self._resolved.items()):
                if now - seen > self._retain_s:
                    del self._resolved[key]
            logger.info("prefill fleet: %d address(es) from DNS", found)

    def _add(self, entry: str) -> None:
        if entry.startswith(DNS_PREFIX):
            name, port = _split(entry[len(DNS_PREFIX) :], "--prefill-allow")
            self._dns.append(_DnsEntry(name, port))
        elif entry.startswith("[") and "]:" in entry or entry.count(":") == 1:
            self._addresses.add(_split(entry, "--prefill-allow"))  # host:port, [v6]:port
        elif entry:
            self._hosts.add(entry.strip("[]"))  # a host name, an IPv4 or IPv6 address
        else:
            raise ValueError("--prefill-allow entries must not be empty")


def _split(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port, got {address!r}")
    return host.strip("[]"), int(port)
