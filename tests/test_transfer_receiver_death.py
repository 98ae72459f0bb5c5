"""A KV receiver whose worker thread dies ends every pending lease with UNAVAILABLE.

The fault is injected into the thread (an EMFILE in its sweep, an OOM in a verify's
checksum); what must follow is exactly one completion per lease, each
``UnavailableError``, a refused ``expect``, ``failure`` naming the cause, the owner woken
through ``notify``, and a ``close`` that still works.
"""

from __future__ import annotations

import errno
import threading
import time

import pytest

from engine.errors import CancelledError, UnavailableError
from engine.transfer.base import KVReceiver, RecvCompletion
from engine.transfer.factory import make_receiver
from tests.transfer_peer import NIXL, SMALL_GROUPS, small_layout

KINDS = ["shm", "gloo", NIXL]


def _completions(receiver: KVReceiver, count: int, timeout: float = 10.0) -> list[RecvCompletion]:
    got: list[RecvCompletion] = []
    end = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < end:
        got += receiver.poll()
        time.sleep(0.005)
    assert len(got) == count, f"{len(got)} of {count} leases ended: {got}"
    return got


def _deadline() -> float:
    return time.monotonic() + 60.0


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_in_the_sweep_fails_every_pending_lease(kind: str) -> None:
    woken = threading.Event()
    receiver = make_receiver(kind, small_layout(), 16, config=SMALL_GROUPS, notify=woken.set)
    try:
        receiver.expect("a", (1, 2), 1, _deadline())
        receiver.expect("b", (3,), 1, _deadline())
        receiver.expect("c", (4,), 1, _deadline())
        receiver.cancel("c")  # already ending: keeps its own outcome

        def sweep():  # noqa: ANN202
            raise OSError(errno.EMFILE, "Too many open files (injected)")

        with receiver._cond:  # type: ignore[attr-defined]
            receiver._sweep = sweep  # type: ignore[attr-defined]
            receiver._cond.notify()  # type: ignore[attr-defined]
        ended = {c.request_id: c for c in _completions(receiver, 3)}
        assert isinstance(ended["a"].error, UnavailableError)
        assert isinstance(ended["b"].error, UnavailableError)
        assert "worker thread died" in str(ended["a"].error)
        assert "Too many open files" in str(ended["a"].error)
        assert isinstance(ended["c"].error, CancelledError)
        assert woken.wait(5)
        assert isinstance(receiver.failure, OSError)
        with pytest.raises(UnavailableError, match="worker thread died"):
            receiver.expect("late", (5,), 1, _deadline())
        time.sleep(0.3)
        assert receiver.poll() == []  # exactly one completion per lease
    finally:
        receiver.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_in_a_verify_fails_that_lease_and_the_others(kind: str) -> None:
    """An OOM while checksumming one lease: that lease, the one being verified, has left
    the lease table; it must still end, and so must every other."""
    receiver = make_receiver(kind, small_layout(), 16, config=SMALL_GROUPS)
    try:
        receiver.expect("verifying", (1, 2), 1, _deadline())
        receiver.expect("waiting", (3, 4), 1, _deadline())

        def check(lease):  # noqa: ANN001, ANN202
            raise MemoryError("checksum staging (injected)")

        receiver._check = check  # type: ignore[attr-defined]
        if kind in ("gloo", "nixl"):  # the data must have "arrived" for the verify to start
            with receiver._cond:  # type: ignore[attr-defined]
                receiver._leases["verifying"].arrived = True  # type: ignore[attr-defined]
        receiver.verify("verifying", 1234, 1)
        ended = {c.request_id: c for c in _completions(receiver, 2)}
        assert set(ended) == {"verifying", "waiting"}
        assert all(isinstance(c.error, UnavailableError) for c in ended.values()), ended
        assert isinstance(receiver.failure, MemoryError)
        time.sleep(0.3)
        assert receiver.poll() == []
    finally:
        receiver.close()
