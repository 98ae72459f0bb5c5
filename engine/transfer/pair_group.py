"""The plumbing of a 2-rank process group between one sender and one receiver.

How the pair group is built and waited on (``PairGroup``; nccl subclasses it), how the
receiver's TCPStore is reached, the group's rendezvous store (``SealedStore`` with a
fleet secret), ``HelloInbox``, the receiver's intake of hellos that no sender can hold
up, and ``KeySeries``, the store wait that idles for free and can be interrupted. No
lease or job logic lives here.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import (
    AbortedError,
    BatonError,
    DeadlineExceededError,
    PermissionDeniedError,
    UnavailableError,
    drop_frame_locals,
)
from engine.transfer.base import TransferConfig
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.store_protocol import (
    GROUP_HEADER_BYTES,
    KEY_HELLO_BELL,
    KEY_HELLO_COUNT,
    hello_key,
    seal,
    unseal,
)

# An idle key wait sleeps this long before it re-checks for an abandoned hello; it is
# woken at once by the key it waits for or by ``KeySeries.interrupt``.
_IDLE_WAIT = timedelta(minutes=5)
_SENTINEL = b"\x00baton-stop"
RECEIVER_RANK, SENDER_RANK = 0, 1
_HANDSHAKE_POLL_S = 0.005
_FORGED_POLL_S = 0.01
# Hello numbers a receiver keeps watching at once; older ones taken and never used are
# given up at once (a store client that adds 10**9 to the counter costs us nothing).
_MAX_PENDING_HELLOS = 256
logger = logging.getLogger(__name__)


def group_timeout_s(config: TransferConfig) -> float:
    """The process group's own operation timeout: longer than any wait of ours (a stall or
    a connect), so our deadline, which ends the pair, always fires before the backend's
    watchdog does."""
    return config.stall_timeout_s + config.connect_timeout_s


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return host, int(port)


def local_address_towards(host: str) -> str:
    """The local IP that routes to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


def rendezvous_store(store: dist.Store, prefix: str, config: TransferConfig) -> dist.Store:
    """The store a pair group under ``prefix`` meets through: sealed with the fleet's
    secret when there is one, so neither side connects to an address (or joins an NCCL
    id) that someone else wrote there."""
    prefixed = dist.PrefixStore(prefix, store)
    if config.fleet_key is None:
        return prefixed
    return SealedStore(prefixed, config.fleet_key, prefix, config.connect_timeout_s)


class SealedStore(dist.Store):
    """A store whose values are sealed (``store_protocol.seal``) under ``scope``: ``get``
    returns only what a holder of the fleet's secret ``set`` under that very key. A forged
    value is waited past for up to ``patience_s`` (the genuine writer's overwrites it),
    then ``PermissionDeniedError``. Counters (``add``) pass through: they are never
    trusted for more than a count."""

    def __init__(self, inner: dist.Store, key: FleetKey, scope: str, patience_s: float) -> None:
        super().__init__()
        self._inner = inner
        self._key = key
        self._scope = scope
        self._patience_s = patience_s

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, seal(self._key, self._scope, key, data))

    def get(self, key: str) -> bytes:
        end = time.monotonic() + self._patience_s
        while (value := unseal(self._key, self._scope, key, self._inner.get(key))) is None:
            if time.monotonic() >= end:
                raise PermissionDeniedError(
                    f"rendezvous value {key!r} of {self._scope} does not carry the fleet's secret"
                )
            time.sleep(_FORGED_POLL_S)
        return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        def sealed(value: bytes | str) -> bytes:
            data = value.encode() if isinstance(value, str) else bytes(value)
            return seal(self._key, self._scope, key, data) if data else data

        raw = self._inner.compare_set(key, sealed(expected), sealed(desired))
        value = unseal(self._key, self._scope, key, raw)
        if value is None:
            raise PermissionDeniedError(
                f"rendezvous value {key!r} of {self._scope} does not carry the fleet's secret"
            )
        return value

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()


def read_sealed(
    store: dist.Store, name: str, key: FleetKey | None, scope: str, timeout_s: float
) -> bytes | None:
    """The value under ``name`` once it is stored and, with a fleet secret, sealed for
    ``scope``. A forged value is waited past, since the genuine writer's overwrites it;
    None if nothing genuine came within ``timeout_s``. Raises ``dist.DistStoreError`` if
    nothing at all was stored by then."""
    end = time.monotonic() + timeout_s
    store.wait([name], timedelta(seconds=max(timeout_s, 0.001)))
    while True:
        value = unseal(key, scope, name, store.get(name))
        if value is not None:
            return value
        if time.monotonic() >= end:
            return None
        time.sleep(_FORGED_POLL_S)


def abort_group(pg: dist.ProcessGroup) -> None:
    """End a pair group's pending operations now; a failure to do so is logged only."""
    try:
        pg.abort()
    except RuntimeError as exc:
        logger.warning("aborting a pair group failed: %s", exc)


def release_failed_group(pg: dist.ProcessGroup, exc: BaseException) -> None:
    """Let go of a group whose setup failed without blocking the caller.

    A group dropped (or aborted) with an operation pending blocks whoever drops it until
    that operation times out, and an exception carries its frames far, to the event
    loop included. So ``exc``'s frames let go of their locals, and a short-lived daemon
    thread aborts the group and holds it until every other reference is gone, so that
    the reaper, not the caller, is the one that drops it last (a caller that clears its
    own variable just after this call would otherwise block in the group's destructor
    whenever the reaper was quicker).
    """
    drop_frame_locals(exc)
    reaper = threading.Thread(target=_reap, args=(pg,), name="baton-pair-reaper", daemon=True)
    reaper.start()


# While ``_reap`` runs, its group is referenced by its own variable, the thread's argument
# tuple and ``sys.getrefcount``'s argument.
_REAPER_OWN_REFS = 3
_REAPER_HOLD_S = 600.0  # a holder this slow is a leak of its own; the reaper lets go


def _reap(pg: dist.ProcessGroup) -> None:
    abort_group(pg)
    give_up = time.monotonic() + _REAPER_HOLD_S
    pause = 0.001
    while sys.getrefcount(pg) > _REAPER_OWN_REFS and time.monotonic() < give_up:
        time.sleep(pause)
        pause = min(pause * 2, 0.25)


def link_error(exc: Exception, what: str) -> BatonError:
    """Map a process-group failure to the typed error it means. A time-out is a peer that
    went silent on the wire: ``AbortedError``, which the gateway retries before the first
    token; only a caller's own deadline is ``DeadlineExceededError`` (``past_deadline``)."""
    if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
        return AbortedError(f"{what}: the peer went silent ({exc})")
    return UnavailableError(f"{what}: peer lost ({exc})")


def past_deadline(error: BatonError, deadline: float, what: str) -> BatonError:
    """``error`` as the caller should see it: a silent peer (``AbortedError``) whose wait
    was cut short by ``deadline`` (``time.monotonic()``, the job's) is that deadline
    passing."""
    if isinstance(error, AbortedError) and time.monotonic() >= deadline:
        return DeadlineExceededError(f"{what}: the deadline passed ({error})")
    return error


class PairGroup:
    """How a backend builds a pair group and waits on it: gloo here, nccl overrides it.

    Stateless apart from its device; every method runs on the one thread that owns the
    group (a receiver's pair thread or a sender's worker).
    """

    device = torch.device("cpu")  # where staging buffers and the pool live

    def make(
        self, store: dist.Store, prefix: str, rank: int, hostname: str, config: TransferConfig
    ) -> dist.ProcessGroup:
        """Build this side of the group under ``prefix``; ``hostname``: the local address
        the peer can reach us on. Gloo blocks until the other rank joins and raises
        ``RuntimeError`` after the connect timeout (its ops get explicit timeouts)."""
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        options._timeout = timedelta(seconds=config.connect_timeout_s)
        return dist.ProcessGroupGloo(rendezvous_store(store, prefix, config), rank, 2, options)

    def handshake(
        self,
        pg: dist.ProcessGroup,
        timeout_s: float,
        what: str,
        give_up: Callable[[], str | None] | None = None,
    ) -> None:
        """One all-reduce of a single element over the new group: returns once both sides'
        group exists and works (NCCL creates its communicator here, not at the first
        transfer). ``give_up`` is polled meanwhile; a reason from it, an expired
        ``timeout_s`` or a failed operation raise a typed ``BatonError``."""
        probe = torch.ones(1, device=self.device)
        work = pg.allreduce([probe])
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            reason = give_up() if give_up is not None else None
            if reason is not None:
                raise UnavailableError(f"{what}: {reason}")
            if time.monotonic() > deadline:
                raise AbortedError(f"{what}: the pair group did not form within {timeout_s:.1f} s")
            time.sleep(_HANDSHAKE_POLL_S)
        try:
            work.wait()
        except RuntimeError as exc:
            reason = give_up() if give_up is not None else None
            if reason is not None:  # the peer's own account beats "connection closed"
                raise UnavailableError(f"{what}: {reason}") from exc
            raise link_error(exc, what) from exc
        if int(probe.item()) != 2:
            raise AbortedError(f"{what}: handshake summed to {probe.item()}, expected 2")

    def wait(self, work: dist.Work, pg: dist.ProcessGroup, timeout_s: float, what: str) -> None:
        """Block until ``work`` is done. Raises ``AbortedError`` after ``timeout_s`` (the
        peer went silent) or ``UnavailableError`` if the peer is lost; either way the group
        is broken (gloo closes the pair on a timeout) and must be dropped."""
        try:
            work.wait(timedelta(seconds=max(timeout_s, 0.001)))
        except RuntimeError as exc:
            raise link_error(exc, what) from exc

    def header(self, message: torch.Tensor) -> list[int]:
        """The in-band group header of a received message (host values)."""
        return message[:GROUP_HEADER_BYTES].view(torch.int64).tolist()

    def set_header(self, message: torch.Tensor, values: list[int]) -> None:
        """Write the in-band group header into a message about to be sent."""
        words = torch.tensor(values, dtype=torch.int64).view(torch.uint8)
        message[:GROUP_HEADER_BYTES].copy_(words)


class KeySeries:
    """Hands out the values of keys ``key_of(n)``, ``key_of(n + 1)``, ... as they appear.

    ``take`` blocks in one long store wait, so an idle series costs nothing; ``interrupt``
    wakes it for good by writing a sentinel under the key it waits on.
    """

    def __init__(self, store: dist.TCPStore, key_of: Callable[[int], str], first: int) -> None:
        self._store = store  # this series' own connection: a store wait holds it
        self._key_of = key_of
        self._next = first
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def position(self) -> int:
        return self._next

    def take(self, on_idle: Callable[[int], bool] | None = None) -> bytes | None:
        """The next value (its key is deleted), or None once interrupted. ``on_idle(n)``
        runs after each long wait that saw nothing; returning True skips key n."""
        while True:
            with self._lock:
                if self._stopped:
                    return None
                key = self._key_of(self._next)
            try:
                self._store.wait([key], _IDLE_WAIT)
            except dist.DistStoreError:
                if on_idle is not None and on_idle(self._next):
                    with self._lock:
                        self._next += 1
                continue
            raw = self._store.get(key)
            self._store.delete_key(key)
            with self._lock:
                self._next += 1
                if raw == _SENTINEL or self._stopped:
                    return None
            return raw

    def interrupt(self, store: dist.TCPStore) -> None:
        """Make ``take`` return None; ``store`` is any connection but this series' own."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            store.set(self._key_of(self._next), _SENTINEL)


class HelloInbox:
    """The receiver's intake of hellos: each one as soon as it is stored, in any order.

    A sender takes a number (``KEY_HELLO_COUNT``), stores its hello under it and rings
    ``KEY_HELLO_BELL``. Anyone who reaches the store can take a number and never use it
    (or die between the two steps); such a number is given up ``abandon_s`` after it was
    first seen taken, and no other hello ever waits behind it. ``take`` idles in a store
    wait on the bell (one round trip per ``abandon_s`` while idle); ``interrupt`` ends it
    for good.
    """

    def __init__(self, store: dist.TCPStore, abandon_s: float) -> None:
        self._store = store  # the inbox's own connection: a store wait holds it
        self._abandon_s = abandon_s
        self._seen = 0  # every number up to this one has been noticed as taken
        self._pending: dict[int, float] = {}  # taken, no hello yet -> when noticed
        self._ready: deque[tuple[int, bytes]] = deque()
        self._lock = threading.Lock()
        self._stopped = False

    def take(self) -> tuple[int, bytes] | None:
        """The next ``(number, hello)`` (its key deleted), or None once interrupted."""
        while True:
            with self._lock:
                if self._stopped:
                    return None
            if self._ready:
                return self._ready.popleft()
            # Unring first: a hello stored after the scan rings again and ends the wait.
            self._store.delete_key(KEY_HELLO_BELL)
            self._scan()
            if self._ready:
                continue
            now = time.monotonic()
            due = [noticed + self._abandon_s - now for noticed in self._pending.values()]
            # Idle, it still looks every ``abandon_s``: a sender of a version before the
            # bell says hello without ringing it.
            wait = min(due) if due else self._abandon_s
            try:
                self._store.wait([KEY_HELLO_BELL], timedelta(seconds=max(wait, 0.01)))
            except dist.DistStoreError:
                pass  # time to give up on a number, or an idle re-check

    def _scan(self) -> None:
        now = time.monotonic()
        taken = self._store.add(KEY_HELLO_COUNT, 0)
        first = max(self._seen + 1, taken - _MAX_PENDING_HELLOS + 1)
        if first > self._seen + 1:
            logger.warning(
                "hellos %d to %d were taken faster than any sender says hello; given up",
                self._seen + 1,
                first - 1,
            )
        for n in range(first, taken + 1):
            self._pending[n] = now
        self._seen = max(self._seen, taken)
        if len(self._pending) > _MAX_PENDING_HELLOS:
            for n in sorted(self._pending)[:-_MAX_PENDING_HELLOS]:
                del self._pending[n]
        for n, noticed in sorted(self._pending.items()):
            key = hello_key(n)
            if self._store.check([key]):
                raw = self._store.get(key)
                self._store.delete_key(key)
                del self._pending[n]
                self._ready.append((n, raw))
            elif now - noticed > self._abandon_s:
                del self._pending[n]
                logger.warning(
                    "hello %d was taken but never said within %.1f s; given up", n, self._abandon_s
                )

    def interrupt(self, store: dist.TCPStore) -> None:
        """Make ``take`` return None; ``store`` is any connection but the inbox's own."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        store.set(KEY_HELLO_BELL, b"stop")
