"""Write claims on shm lease tables are taken and given back by compare-and-swap: a stale
sender never erases a live one's claim, and two senders never hold a block at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.errors import AbortedError, CancelledError
from engine.transfer.base import KVReceiver, RecvCompletion, SendJob
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.shm import ShmLink
from engine.transfer.writer_liveness import writer_id
from tests.transfer_peer import SMALL_GROUPS, blocks, random_pool, small_layout, wait_for


def _deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


def _poll_within(receiver: KVReceiver, seconds: float) -> list[RecvCompletion]:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = receiver.poll()
        if got:
            return got
        time.sleep(0.005)
    return []


def test_a_stale_sender_never_erases_a_live_senders_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill P1 sits throttled with a queued job for lease A; A expires and the same
    blocks go to P2 as lease B. P1 wakes while P2 is mid-copy: it must not clear P2's
    claim, or cancelling B frees the blocks at once, they are leased as C, and P2's
    copy lands in C's blocks."""
    layout = small_layout()  # 4 layers, one per group (SMALL_GROUPS)
    receiver = make_receiver("shm", layout, 16, config=SMALL_GROUPS)
    p1 = make_sender("shm", random_pool(layout, 16, seed=1), layout, SMALL_GROUPS)
    p2 = make_sender("shm", random_pool(layout, 16, seed=2), layout, SMALL_GROUPS)
    dst = (3, 4)
    p1_frozen, p1_go = threading.Event(), threading.Event()
    p2_mid_copy, p2_go = threading.Event(), threading.Event()

    def throttle_p1(request_id: str, group: int) -> None:
        if group == -1:  # the job is P1's next, but P1 gets no CPU
            p1_frozen.set()
            p1_go.wait(30)

    p1._on_group = throttle_p1  # type: ignore[attr-defined]
    copy_group = ShmLink._copy_group
    p2_id = writer_id(p2.incarnation)

    def slow_copy(self: ShmLink, group: int, *args: object) -> int:
        if self._writer == p2_id and group == 1:  # lease checked, copy not yet landed
            p2_mid_copy.set()
            p2_go.wait(30)
        return copy_group(self, group, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ShmLink, "_copy_group", slow_copy)
    try:
        lease_a = receiver.expect("req-a", dst, 1, _deadline(0.5))
        p1.submit(SendJob("req-a", (5, 6), lease_a, _deadline()))
        assert p1_frozen.wait(10)
        assert isinstance(wait_for(receiver.poll, 10).error, AbortedError)  # A expired

        lease_b = receiver.expect("req-b", dst, 2, _deadline())  # the gateway's retry
        p2.submit(SendJob("req-b", (7, 8), lease_b, _deadline()))
        assert p2_mid_copy.wait(10)
        p1_go.set()  # P1 wakes and runs its stale job for A
        assert isinstance(wait_for(p1.poll, 10).error, AbortedError)

        receiver.cancel("req-b")  # the client goes away while P2 is mid-copy
        ended = _poll_within(receiver, 1.0)
        if not ended:  # B waits out P2's claim, as it must
            p2_go.set()
            ended = [wait_for(receiver.poll, 10)]
        assert isinstance(ended[0].error, CancelledError)

        receiver.expect("req-c", dst, 3, _deadline())
        leased_to_c = blocks(receiver.kv_cache, dst).clone()
        p2_go.set()
        assert isinstance(wait_for(p2.poll, 10).error, AbortedError)
        assert torch.equal(blocks(receiver.kv_cache, dst), leased_to_c)  # C's blocks unchanged
    finally:
        p1_go.set()
        p2_go.set()
        p1.close()
        p2.close()
        receiver.close()


def test_two_senders_on_one_lease_take_turns() -> None:
    """Two senders given the same lease never claim a block at once: the second waits
    for the first's claims, then writes the same bytes, and the lease verifies."""
    layout = small_layout()
    source = random_pool(layout, 16, seed=3)
    receiver = make_receiver("shm", layout, 16, config=SMALL_GROUPS)
    senders = [make_sender("shm", source, layout, SMALL_GROUPS) for _ in range(2)]
    try:
        lease = receiver.expect("r", (1, 2, 3), 1, _deadline())
        for sender in senders:
            sender.submit(SendJob("r", (4, 5, 6), lease, _deadline()))
        done = [wait_for(sender.poll, 10) for sender in senders]
        assert all(d.ok for d in done) and done[0].checksum == done[1].checksum
        receiver.verify("r", done[0].checksum or 0, 1)
        assert wait_for(receiver.poll, 10).ok
        assert torch.equal(blocks(receiver.kv_cache, (1, 2, 3)), blocks(source, (4, 5, 6)))
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
