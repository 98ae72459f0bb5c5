"""Whether a shared-memory writer (a KV sender on this host) is still alive.

A sender that writes straight into a receiver's pool (shm, cuda_ipc) holds an exclusive
``flock`` on its own file in /dev/shm for its whole life; the kernel drops the lock the
moment the process dies, SIGKILL included. A receiver holding a block whose write claim
stands asks ``writer_alive``: a stalled sender (SIGSTOP, CPU throttling, a copy queued
behind a long kernel) still holds its lock, so its blocks stay quarantined; a dead one
does not, so its claims can be cleared. Works across PID namespaces (co-located
containers) as long as /dev/shm is shared, which those transports need anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid

_DIR = "/dev/shm"
_PREFIX = "baton_tx_"


def writer_id(incarnation: str) -> int:
    """The positive 63-bit id a sender incarnation stamps on the blocks it claims."""
    return (uuid.UUID(hex=incarnation).int >> 65) or 1


def _path(wid: int) -> str:
    return f"{_DIR}/{_PREFIX}{wid:016x}"


class WriterLock:
    """The lock a live sender holds. ``close`` (or process death) releases it."""

    def __init__(self, incarnation: str) -> None:
        self.id = writer_id(incarnation)
        self._path = _path(self.id)
        self._fd: int | None = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    def close(self) -> None:
        """Release and remove the lock file. Idempotent."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        os.close(self._fd)  # closing drops the flock
        self._fd = None


def writer_alive(wid: int) -> bool:
    """True while the sender with id ``wid`` holds its lock (alive, even if stopped)."""
    if wid <= 0:
        return False
    try:
        fd = os.open(_path(wid), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops a lock we took
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(wid))  # a dead sender's leftover: nobody will lock it again
    return False
