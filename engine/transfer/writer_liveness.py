"""Whether a shared-memory writer (a KV sender on this host) is still alive.

A sender that writes straight into a receiver's pool (shm, cuda_ipc) holds an exclusive
``flock`` on its own file in /dev/shm for its whole life; the kernel drops the lock the
moment the process dies, SIGKILL included. A receiver holding a block whose write claim
stands asks ``writer_alive``: a stalled sender (SIGSTOP, CPU throttling, a copy queued
behind a long kernel) still holds its lock, so its blocks stay quarantined; a dead one
does not, so its claims can be cleared. Works across PID namespaces (co-located
containers) as long as /dev/shm is shared, which those transports need anyway.

A lock file goes with its sender: ``close`` removes it (the shm sender closes itself at
interpreter exit), as does collecting a ``WriterLock`` never closed. One left by a
process that died (SIGKILL, OOM) is removed by the next ``writer_alive`` that asks about
it, and every new ``WriterLock`` first sweeps the ones nobody holds any more.
A file only ever appears under its final name already locked (created under a temporary
name, locked, then renamed), so a sweep never mistakes a sender starting up for a dead one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
import weakref
from pathlib import Path

logger = logging.getLogger(__name__)

_DIR = "/dev/shm"
_PREFIX = "baton_tx_"


def writer_id(incarnation: str) -> int:
    """The positive 63-bit id a sender incarnation stamps on the blocks it claims."""
    return (uuid.UUID(hex=incarnation).int >> 65) or 1


def _path(wid: int) -> str:
    return f"{_DIR}/{_PREFIX}{wid:016x}"


class WriterLock:
    """The lock a live sender holds. ``close`` or process death releases it; ``close``
    (or collecting this object) also removes its file. Never at interpreter exit by
    itself: its sender may still be writing then, and must be stopped first."""

    def __init__(self, incarnation: str) -> None:
        self.id = writer_id(incarnation)
        self.path = _path(self.id)
        sweep_stale_locks()
        fd = _create_locked(self.path)
        self._release = weakref.finalize(self, _remove, fd, self.path, os.getpid())
        self._release.atexit = False

    def close(self) -> None:
        """Release and remove the lock file. Idempotent."""
        self._release()


def _create_locked(path: str) -> int:
    """Open ``path`` holding an exclusive flock on it; the name never shows unlocked."""
    while True:
        temporary = f"{path}.{uuid.uuid4().hex[:8]}.new"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(temporary, path)
            return fd
        except (BlockingIOError, FileNotFoundError):
            # A sweep took the unlocked temporary file for a dead sender's: start over.
            os.close(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise


def _remove(fd: int, path: str, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child exiting: the lock file is its parent's, still alive
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # before the lock goes, so the name never shows unlocked
    os.close(fd)  # closing drops the flock


def sweep_stale_locks() -> int:
    """Remove the lock files in /dev/shm that no live process holds; return how many."""
    removed = 0
    for path in Path(_DIR).glob(f"{_PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Nobody holds it, and holding it ourselves, nobody can start to.
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                os.unlink(path)
                removed += 1
        except (BlockingIOError, FileNotFoundError):
            pass  # held by a live sender, or removed by another sweep
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d stale KV sender lock file(s) from %s", removed, _DIR)
    return removed


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
