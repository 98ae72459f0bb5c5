"""Blocks whose write claim stands are quarantined, never reused, until the writer lets go
or is known dead; the request itself still ends at once with a typed status."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from engine.errors import AbortedError, CancelledError
from engine.transfer.base import SendJob
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.writer_liveness import WriterLock, writer_alive, writer_id
from tests.transfer_peer import (
    SMALL_GROUPS,
    blocks,
    descriptor_to_json,
    random_pool,
    read_json_line,
    small_layout,
    spawn_peer,
    wait_for,
)

DRAIN = SMALL_GROUPS.drain_s


def _deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


def test_stalled_live_sender_keeps_its_blocks_quarantined() -> None:
    layout = small_layout()
    source = random_pool(layout, 16, seed=2)
    receiver = make_receiver("shm", layout, 32, config=SMALL_GROUPS)
    sender = make_sender("shm", source, layout, SMALL_GROUPS)
    frozen, go = threading.Event(), threading.Event()

    def freeze(request_id: str, group: int) -> None:
        if group == 1:
            frozen.set()
            go.wait(30)  # stalled mid-write: claim set, the process alive

    sender._on_group = freeze  # type: ignore[attr-defined]
    try:
        desc = receiver.expect("r", (3, 4), 1, _deadline())
        sender.submit(SendJob("r", (5, 6), desc, _deadline()))
        assert frozen.wait(10)
        receiver.cancel("r")  # the client went away
        time.sleep(DRAIN + 0.3)
        assert receiver.poll() == []  # no completion: the blocks may not be reused
        assert receiver.num_quarantined == 1
        with pytest.raises(ValueError, match="already leased"):
            receiver.expect("other", (4, 9), 2, _deadline())
        go.set()  # the sender wakes, sees the revoked lease and writes nothing more
        assert isinstance(wait_for(sender.poll).error, AbortedError)
        ended = wait_for(receiver.poll)
        assert isinstance(ended.error, CancelledError)
        assert torch.equal(blocks(receiver.kv_cache, (3, 4))[0], blocks(source, (5, 6))[0])
        assert not blocks(receiver.kv_cache, (3, 4))[1:].any()  # nothing after the stall
        receiver.expect("other", (4, 9), 2, _deadline())  # reusable now
    finally:
        go.set()
        sender.close()
        receiver.close()


def test_killed_sender_releases_its_claims() -> None:
    """A sender process frozen mid-write (SIGSTOP) keeps the blocks quarantined; once it
    is killed its claims are cleared and the lease ends."""
    layout = small_layout()
    receiver = make_receiver("shm", layout, 32, config=SMALL_GROUPS)
    peer = None
    try:
        desc = receiver.expect("r", (7, 8, 9), 1, _deadline())
        peer = spawn_peer(
            "send",
            "--kind",
            "shm",
            "--seed",
            "3",
            "--src",
            "1,2,3",
            "--descriptor",
            descriptor_to_json(desc),
            "--stall-at-group",
            "2",
        )
        assert read_json_line(peer, 30) == {"stalled_at": 2}
        os.kill(peer.pid, signal.SIGSTOP)
        receiver.cancel("r")
        time.sleep(DRAIN + 0.3)
        assert receiver.poll() == [] and receiver.num_quarantined == 1
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(10)
        ended = wait_for(receiver.poll, 5)
        assert isinstance(ended.error, CancelledError)
        assert receiver.num_quarantined == 0
        receiver.expect("again", (7, 8, 9), 2, _deadline())
    finally:
        if peer is not None:
            if peer.poll() is None:
                peer.kill()
                peer.wait(5)
            for pipe in (peer.stdin, peer.stdout):
                if pipe is not None:
                    pipe.close()
        receiver.close()


def test_writer_liveness_follows_the_lock() -> None:
    incarnation = os.urandom(16).hex()
    lock = WriterLock(incarnation)
    assert lock.id == writer_id(incarnation) > 0
    assert writer_alive(lock.id)
    lock.close()
    assert not writer_alive(lock.id)
    assert not writer_alive(0)
