"""Where a worker fleet is: gRPC-style targets resolved to worker addresses.

A fleet is named by targets, each one of:

- ``dns:///NAME:PORT``: every address ``NAME`` resolves to, each at ``PORT``. In
  Kubernetes, NAME is a headless Service, whose DNS answer lists every *ready* pod, so a
  pod that starts draining (not ready) or goes away leaves the answer;
- ``HOST:PORT``: that one address, as written (no lookup).

:class:`Fleet` turns a fleet's targets into the set of worker addresses it has now. The
lookup itself is a :data:`Resolver`, injectable so that tests and the local launcher can
map names without a DNS server (:func:`file_resolver`). A name that does not exist
(NXDOMAIN: a headless Service with no ready pod) resolves to nothing; a lookup that
*fails* (no DNS server, a timeout) keeps that target's last answer, so a DNS outage never
empties a fleet that is serving.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"

# (host, port) -> "ip:port" addresses ([] when the name does not exist now). Raises
# OSError when the lookup itself failed and its answer is unknown.
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class Target:
    """One parsed target: a DNS name to resolve, or a fixed address."""

    text: str  # as written
    host: str
    port: int
    dns: bool  # True: resolve ``host``; False: ``host:port`` is the worker's address

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)


def parse_target(text: str) -> Target:
    """``dns:///NAME:PORT`` or ``HOST:PORT``; ValueError naming the target otherwise."""
    raw = text.strip()
    dns = raw.startswith(DNS_SCHEME)
    rest = raw[len(DNS_SCHEME) :] if dns else raw
    if "://" in rest or (not dns and raw.startswith("dns:")):
        raise ValueError(
            f"target {text!r}: the only scheme understood is dns:/// (dns:///NAME:PORT)"
        )
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # [::1]:50051
        host = host[1:-1]
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        form = "dns:///NAME:PORT" if dns else "HOST:PORT or dns:///NAME:PORT"
        raise ValueError(f"target {text!r} must be {form} with a port in [1, 65535]")
    return Target(text=raw, host=host, port=int(port), dns=dns)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals bracketed as gRPC expects."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


async def system_resolver(host: str, port: int) -> list[str]:
    """The host's resolver (``getaddrinfo``: /etc/hosts, then DNS), TCP addresses only.

    A name that does not exist resolves to ``[]``; any other failure raises OSError.
    """
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in _NO_SUCH_NAME:
            return []
        raise
    seen: dict[str, None] = {}
    for _family, _type, _proto, _name, sockaddr in infos:
        seen[join_host_port(str(sockaddr[0]), int(sockaddr[1]))] = None
    return list(seen)


def file_resolver(path: Path) -> Resolver:
    """A resolver answering from a JSON file, ``{"NAME:PORT": ["HOST:PORT", ...]}``: what a
    headless Service's DNS answer would be (every ready worker), each with its own port.

    The file is read at every lookup, so whoever owns it (the local launcher, a test)
    changes a fleet by replacing it (atomically). A name it lacks does not exist; a
    missing or unreadable file is a failed lookup (OSError), which keeps the last answer.
    """

    async def resolve(host: str, port: int) -> list[str]:
        try:
            answers = json.loads(Path(path).read_text())
        except ValueError as err:  # half-written by hand: a failed lookup, not "no workers"
            raise OSError(f"resolve file {path} is not JSON: {err}") from err
        if not isinstance(answers, dict):
            raise OSError(f"resolve file {path} must hold one JSON object")
        addresses = answers.get(join_host_port(host, port), [])
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise OSError(f"resolve file {path}: {host}:{port} must map to a list of HOST:PORT")
        return list(addresses)

    return resolve


# getaddrinfo's "this name has no addresses" (as opposed to "could not ask").
_NO_SUCH_NAME = {
    code
    for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None))
    if code is not None
}


class Fleet:
    """The workers one fleet's targets name. ``resolve`` is called from one event loop."""

    def __init__(self, kind: str, targets: Sequence[str], resolver: Resolver) -> None:
        self.kind = kind
        self.targets = tuple(parse_target(t) for t in targets)
        if len({t.text for t in self.targets}) != len(self.targets):
            raise ValueError(f"{kind} lists a target twice: {[t.text for t in self.targets]}")
        self._resolver = resolver
        # The last answer of every DNS target; fixed addresses are their own answer.
        self._answers: dict[Target, tuple[str, ...]] = {
            t: () if t.dns else (t.address,) for t in self.targets
        }

    @property
    def dynamic(self) -> bool:
        """True when some target is a DNS name, whose answer may change."""
        return any(t.dns for t in self.targets)

    def addresses(self) -> list[str]:
        """Every address of the last answers, in target order, each once."""
        seen: dict[str, None] = {}
        for target in self.targets:
            for address in self._answers[target]:
                seen[address] = None
        return list(seen)

    async def resolve(self) -> list[str]:
        """Look every DNS target up again; returns :meth:`addresses` afterwards.

        A failed lookup keeps its target's previous answer (and is logged).
        """
        for target in self.targets:
            if not target.dns:
                continue
            try:
                answer = tuple(await self._resolver(target.host, target.port))
            except OSError as err:
                logger.warning(
                    "%s target %s: lookup failed (%s); keeping its last answer (%d address(es))",
                    self.kind,
                    target.text,
                    err,
                    len(self._answers[target]),
                )
                continue
            if answer != self._answers[target]:
                logger.info(
                    "%s target %s resolves to %s", self.kind, target.text, list(answer) or "nothing"
                )
            self._answers[target] = answer
        return self.addresses()
