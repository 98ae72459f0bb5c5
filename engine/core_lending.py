"""Cores that workers on one host lend each other while they have nothing to compute.

The launcher's core plan (``gateway.core_plan``) gives each worker a share of the
host's cores, so that no two OpenMP teams spin against each other. A share is then
idle whenever its workers are: on 2 cores, a decode worker of a 1 prefill + 1 decode pair
ran its streams on one core while the prefill worker's core waited for the next prompt
(``benchmarks/results/workers_on_one_host_*``: 121.8 tok/s against 173.0 in one process).
With more workers than cores, several own one share (a team of one thread each), and a
fresh prompt's prefill got a part of one core while another core idled.

So each share is a file in a directory the launcher makes, and each of its owners has a
seat file beside it (``--core-seat``). A worker holds an exclusive ``flock`` on its seat
while it has work (that is how others see it busy) and a shared one on its share's file.
It borrows the share of any whose owners are all idle: it takes that file's lock,
exclusive and without waiting, widens its affinity mask and its compute team by the
share, and gives it back at the start of its next forward once an owner is busy again,
or as soon as it has no work itself. An owner that wakes up waits for its share's lock:
at most one forward of the borrower, which a step's token budget bounds, and at most
``RECLAIM_WAIT_S``. A worker whose share a co-owner computes on runs on the shares it
borrowed instead, if any (it moves rather than crowd the co-owner), else at home. The
locks keep the rule of the plan: no more compute threads at work than cores, but for the
rest of a forward past that bound, or co-owners at home together. Waiting for one's own
share happens only while holding no other, so two workers never wait on each other; a
worker that dies drops its locks with its file descriptors.

Share file layout (2 bytes): the launcher keeps the share open for borrowing (1) or has
closed it (0, when a later worker got a plan of its own over the same cores); the team
size of one owner on it. Seat files are empty: only their locks speak.

Deterministic workers lend but never borrow: their kernels' reduction order must not
change with the team. Torch-free; the caller applies the :class:`Team`.

The workers that borrow from one directory form a *core group* (:func:`core_group`): the
router packs a group's decode streams onto one of them, which then runs on the cores the
idle others lend, rather than spread them so that each reads the weights for its own
small batch on its own core.
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
SEAT_SUFFIX = ".seat"
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


def core_group(directory: Path) -> str:
    """The name shared by every worker that borrows from ``directory``: the boot's id and
    the directory, so that workers on different hosts (or boots) never share one."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the host's name stands in
        boot = os.uname().nodename
    return f"{boot}:{directory.resolve()}"


def share_path(directory: Path, cpus: frozenset[int]) -> Path:
    return directory / f"{format_cpu_list(cpus)}{SHARE_SUFFIX}"


def seat_path(directory: Path, cpus: frozenset[int], seat: int) -> Path:
    return directory / f"{format_cpu_list(cpus)}.{seat}{SEAT_SUFFIX}"


def parse_seat(path: Path) -> tuple[Path, frozenset[int], int]:
    """(shares directory, the share's CPUs, seat number) of a seat file's path."""
    cpus, dot, seat = path.name.removesuffix(SEAT_SUFFIX).rpartition(".")
    if not path.name.endswith(SEAT_SUFFIX) or not dot or not seat.isdigit():
        raise ValueError(f"core seat must be a <cpus>.<n>{SEAT_SUFFIX} file, got {str(path)!r}")
    return path.parent, parse_cpu_list(cpus), int(seat)


def create_share(directory: Path, cpus: frozenset[int], threads: int, owners: int = 1) -> Path:
    """The launcher's side: one share, open for borrowing, with a seat for each of its
    ``owners``; lent until an owner starts computing."""
    if not cpus:
        raise ValueError("cpus must name at least one CPU")
    if not 1 <= threads <= 255:
        raise ValueError(f"threads must be in [1, 255], got {threads}")
    if owners < 1:
        raise ValueError(f"owners must be >= 1, got {owners}")
    path = share_path(directory, cpus)
    path.write_bytes(bytes([1, threads]))
    for seat in range(owners):
        seat_path(directory, cpus, seat).touch()
    return path


def close_shares(directory: Path) -> None:
    """The launcher's side: no share of ``directory`` may be borrowed from now on (a
    worker started later was planned over the same cores); borrowers give them back at
    their next forward."""
    for path in directory.glob(f"*{SHARE_SUFFIX}"):
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x00", 0)
        finally:
            os.close(fd)


class _Share:
    """One share's file and its owners' seats, opened by one worker: its own share (then
    without its own seat) or one it may borrow."""

    def __init__(self, path: Path, own_seat: Path | None = None):
        self.path = path
        self.cpus = parse_cpu_list(path.name.removesuffix(SHARE_SUFFIX))
        self.fd = os.open(path, os.O_RDWR)
        raw = os.pread(self.fd, 2, 0)
        self.threads = max(1, raw[1]) if len(raw) == 2 else 1
        self.held = False
        seats = path.parent.glob(f"{format_cpu_list(self.cpus)}.*{SEAT_SUFFIX}")
        self._seats = [os.open(p, os.O_RDONLY) for p in sorted(seats) if p != own_seat]

    def is_open(self) -> bool:
        return os.pread(self.fd, 1, 0) == b"\x01"

    def owners_busy(self) -> bool:
        """Whether an owner (but the opener) has work: holds its seat. Probing takes the
        seat shared for a moment, so probes never make each other see a busy owner."""
        for fd in self._seats:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def try_lock(self, shared: bool) -> bool:
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
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
        for fd in (self.fd, *self._seats):
            os.close(fd)


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
        seat: int = 0,
        borrow: bool = True,
        reclaim_wait_s: float = RECLAIM_WAIT_S,
    ):
        if not home:
            raise ValueError("home must name at least one CPU")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.home = Team(frozenset(home), threads)
        self.borrow = borrow
        # Only a borrower gains from the streams its group packs onto it.
        self.group = core_group(directory) if borrow else ""
        self.reclaim_wait_s = reclaim_wait_s
        self._lock = threading.Lock()
        own, mine = share_path(directory, self.home.cpus), seat_path(directory, home, seat)
        self._own = _Share(own, own_seat=mine) if own.exists() else None
        self._seat = os.open(mine, os.O_RDONLY) if self._own and mine.exists() else None
        self._busy = False
        self._others = [
            _Share(p)
            for p in sorted(directory.glob(f"*{SHARE_SUFFIX}"))
            if p != own and not (parse_cpu_list(p.name.removesuffix(SHARE_SUFFIX)) & home)
        ]
        self.waited_s = 0.0  # time spent waiting for the own share to come back
        self.borrowed_forwards = 0  # forwards that ran on a team other than home
        # The own share was not given back in time: until it gets it back, this worker
        # takes it only if free, rather than wait at every forward.
        self._gave_up = False

    def team(self) -> Team:
        """Take the own share back (waiting for its borrower's current forward to end),
        borrow every idle share that is open, give back those whose owners are busy."""
        with self._lock:
            if not self._busy:
                if self._seat is not None:
                    # Others only probe it, for a moment: this never waits long.
                    fcntl.flock(self._seat, fcntl.LOCK_EX)
                self._busy = True
            own = self._own
            if own is not None and not own.held:
                if own.try_lock(shared=True):
                    self._gave_up = False
                elif not self._gave_up:
                    self._reclaim(own)
            if not self.borrow:
                return self.home
            cpus: set[int] = set()
            threads = 0
            for share in self._others:
                if share.held and (not share.is_open() or share.owners_busy()):
                    share.unlock()
                elif not share.held and share.is_open() and not share.owners_busy():
                    share.try_lock(shared=False)
                if share.held:
                    cpus |= share.cpus
                    threads += share.threads
            if not cpus or own is None or not own.owners_busy():
                cpus |= self.home.cpus
                threads += self.home.threads
            team = Team(frozenset(cpus), threads)
            if team != self.home:
                self.borrowed_forwards += 1
            return team

    def idle(self) -> None:
        """No work: give back what was borrowed and lend the own share."""
        with self._lock:
            for share in self._others:
                share.unlock()
            if self._own is not None:
                self._own.unlock()
            if self._busy and self._seat is not None:
                fcntl.flock(self._seat, fcntl.LOCK_UN)
            self._busy = False

    def close(self) -> None:
        with self._lock:
            for share in (*self._others, *([self._own] if self._own else [])):
                share.close()
            if self._seat is not None:
                os.close(self._seat)
            self._others, self._own, self._seat = [], None, None

    def _reclaim(self, own: _Share) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.reclaim_wait_s
        while not own.try_lock(shared=True):
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
