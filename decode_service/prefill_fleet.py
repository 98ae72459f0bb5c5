"""Which prefill workers a decode worker may dial: its fleet, and no one else.

A ``Decode`` call names the prefill worker to use (``prefill_address``), and decode hands
that worker a KV descriptor of its own pool. So a caller must not be able to point it at
an arbitrary address. The allow-list (``--prefill-allow``, repeated or comma-separated)
holds entries of three kinds:

- ``host:port``: exactly that address;
- ``host``: any port on that host;
- ``dns:///name:port``: the addresses ``name`` resolves to, at that port (a headless
  Service: every ready pod). Resolved at start and again, at most once a second, when an
  address is not found, so new pods are accepted as the gateway discovers them.

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
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import PermissionDeniedError

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
# A miss re-resolves the DNS entries, but not more often than this.
RESOLVE_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class _DnsEntry:
    name: str
    port: int


class PrefillFleet:
    """The allow-list. ``check`` is the one question; it may resolve DNS entries."""

    def __init__(self, entries: Sequence[str]) -> None:
        self._hosts: set[str] = set()
        self._addresses: set[tuple[str, int]] = set()
        self._dns: list[_DnsEntry] = []
        for entry in entries:
            self._add(entry.strip())
        self._resolved: set[tuple[str, int]] = set()
        self._resolved_at = -RESOLVE_INTERVAL_S
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
            if (host, port) in self._resolved:
                return
            await self._refresh()
            if (host, port) in self._resolved:
                return
        raise PermissionDeniedError(
            f"prefill_address {address!r} is not a prefill worker of this decode worker's "
            "fleet (--prefill-allow)"
        )

    async def _refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._resolved_at < RESOLVE_INTERVAL_S:
                return
            self._resolved_at = time.monotonic()
            loop = asyncio.get_running_loop()
            resolved: set[tuple[str, int]] = set()
            for entry in self._dns:
                try:
                    infos = await loop.getaddrinfo(entry.name, entry.port, type=socket.SOCK_STREAM)
                except OSError as err:
                    logger.warning("prefill fleet: cannot resolve %s: %s", entry.name, err)
                    continue
                resolved.update((str(info[4][0]), entry.port) for info in infos)
            self._resolved = resolved
            logger.info("prefill fleet: %d address(es) from DNS", len(resolved))

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
