"""Cores that workers on one host lend each other while they have nothing to compute.

The launcher's core plan (``gateway.core_plan``) gives each worker a disjoint share of
the host's cores, so that no two OpenMP teams spin against each other. A share is then
idle whenever its worker is: on 2 cores, a decode worker of a 1 prefill + 1 decode pair
ran its streams on one core while the prefill worker's core waited for the next prompt
(``benchmarks/results/workers_on_one_host_*``: 121.8 tok/s against 173.0 in one process).

So each planned worker's share is a file in a directory the launcher makes
(``--core-shares``). A worker holds an exclusive ``flock`` on its own share's file while
it has work, and borrows the share of any worker that has none: it takes that file's
lock without waiting, widens its affinity mask and its compute team by the share, and
gives it back at the start of its next forward once the owner asks for it (byte 0 of the
file), or as soon as it has no work itself. An owner that wakes up asks, then waits for
its lock: at most one forward of the borrower, which a step's token budget bounds, and
at most ``RECLAIM_WAIT_S``. The locks keep the rule of the plan: no more compute threads
at work than cores (but for the rest of a forward past that bound). Waiting
for one's own lock happens only while holding no other, so two workers never wait on
each other; a worker that dies drops its locks with its file descriptors.

File layout (3 bytes): the owner wants its share back (1) or lends it (0); the launcher
keeps the share open for borrowing (1) or has closed it (0, when a later worker got a
plan of its own over the same cores); the share's team size.

Deterministic workers lend but never borrow: their kernels' reduction order must not
change with the team. Torch-free; the caller applies the :class:`Team`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.cpu_budget import format_cpu_list, parse_cpu_list

logger = logging.getLogger(__name__)

SHARE_SUFFIX = ".share"
# How long an owner waits for its share before computing beside the borrower anyway:
# past a forward of any step a small model's token budget allows on a slow host, so it
# is mostly a borrower that hangs without dying (SIGSTOP; a dead one drops its locks)
# that makes the owner wait this long, once: it then takes its share only when free,
# without waiting, until it gets it back.
RECLAIM_WAIT_S = 1.0
_POLL_S = 0.0005


@dataclass(frozen=True, slots=True)
class Team:
    """Where a forward may run and how wide its OpenMP team is."""

    cpus: frozenset[int]
    threads: int


def share_path(directory: Path, cpus: frozenset[int]) -> Path:
    return directory / f"{format_cpu_list(cpus)}{SHARE_SUFFIX}"


def create_share(directory: Path, cpus: frozenset[int], threads: int) -> Path:
    """The launcher's side: one worker's share, open for borrowing, lent until its owner
    starts computing."""
    if not cpus:
        raise ValueError("cpus must name at least one CPU")
    if not 1 <= threads <= 255:
        raise ValueError(f"threads must be in [1, 255], got {threads}")
    path = share_path(directory, cpus)
    path.write_bytes(bytes([0, 1, threads]))
    return path


def close_shares(directory: Path) -> None:
    """The launcher's side: no share of ``directory`` may be borrowed from now on (a
    worker started later was planned over the same cores); borrowers give them back at
    their next forward."""
    for path in directory.glob(f"*{SHARE_SUFFIX}"):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x00", 1)
        finally:
            os.close(fd)


class _Share:
    """One share's file, opened by one worker: its own or one it may borrow."""

    def __init__(self, path: Path):
        self.path = path
        self.cpus = parse_cpu_list(path.name.removesuffix(SHARE_SUFFIX))
        self.fd = os.open(path, os.O_RDWR)
        raw = os.pread(self.fd, 3, 0)
        self.threads = max(1, raw[2]) if len(raw) == 3 else 1
        self.held = False

    def flags(self) -> tuple[bool, bool]:
        """(the owner wants it back, it is open for borrowing)."""
        raw = os.pread(self.fd, 2, 0)
        return raw[:1] == b"\x01", raw[1:2] == b"\x01"

    def ask(self, want: bool) -> None:
        os.pwrite(self.fd, b"\x01" if want else b"\x00", 0)

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.held = True
        return True

    def unlock(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.held = False

    def close(self) -> None:
        self.unlock()
        os.close(self.fd)


class CoreLending:
    """One worker's side of a shares directory: ``team()`` before each forward, ``idle()``
    when it has no work left. Thread-safe (the compute thread asks for teams; the engine
    loop reports idleness)."""

    def __init__(
        self,
        directory: Path,
        home: frozenset[int],
        threads: int,
        *,
        borrow: bool = True,
        reclaim_wait_s: float = RECLAIM_WAIT_S,
    ):
        if not home:
            raise ValueError("home must name at least one CPU")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.home = Team(frozenset(home), threads)
        self.borrow = borrow
        self.reclaim_wait_s = reclaim_wait_s
        self._lock = threading.Lock()
        own = share_path(directory, self.home.cpus)
        self._own = _Share(own) if own.exists() else None
        self._others = [
            _Share(p)
            for p in sorted(directory.glob(f"*{SHARE_SUFFIX}"))
            if p != own and not (parse_cpu_list(p.name.removesuffix(SHARE_SUFFIX)) & home)
        ]
        self.waited_s = 0.0  # time spent waiting for the own share to come back
        self.borrowed_forwards = 0  # forwards that ran on a team wider than home
        # The own share was not given back in time: until it gets it back, this worker
        # takes it only if free, rather than wait at every forward.
        self._gave_up = False

    def team(self) -> Team:
        """Take the own share back (waiting for its borrower's current forward to end),
        borrow every idle share that is open, give back those whose owners want them."""
        with self._lock:
            own = self._own
            if own is not None and not own.held:
                own.ask(True)
                if own.try_lock():
                    self._gave_up = False
                elif not self._gave_up:
                    self._reclaim(own)
            if not self.borrow:
                return self.home
            cpus, threads = set(self.home.cpus), self.home.threads
            for share in self._others:
                want, open_ = share.flags()
                if share.held and (want or not open_):
                    share.unlock()
                elif not share.held and open_ and not want:
                    share.try_lock()
                if share.held:
                    cpus |= share.cpus
                    threads += share.threads
            if threads > self.home.threads:
                self.borrowed_forwards += 1
            return Team(frozenset(cpus), threads)

    def idle(self) -> None:
        """No work: give back what was borrowed and lend the own share."""
        with self._lock:
            for share in self._others:
                share.unlock()
            if self._own is not None:
                self._own.ask(False)
                self._own.unlock()

    def close(self) -> None:
        with self._lock:
            for share in (*self._others, *([self._own] if self._own else [])):
                share.close()
            self._others = []
            self._own = None

    def _reclaim(self, own: _Share) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.reclaim_wait_s
        while not own.try_lock():
            if time.monotonic() > deadline:
                logger.warning(
                    "core share %s not given back in %.1f s: computing beside its borrower",
                    own.path.name,
                    self.reclaim_wait_s,
                )
                self._gave_up = True
                break
            time.sleep(_POLL_S)
        self.waited_s += time.monotonic() - t0
