"""Blocks whose write claim stands are quarantined, never reused, until the writer lets go
or is known dead; the request itself still ends at once with a typed status."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.errors import AbortedError, CancelledError
from engine.transfer.base import SendJob
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.writer_liveness import WriterLock, writer_alive, writer_id
from tests.transfer_peer import (
    NIXL,
    REPO,
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


@pytest.mark.parametrize("kind", ["shm", NIXL])
def test_stalled_live_sender_keeps_its_blocks_quarantined(kind: str) -> None:
    cut = 0 if kind == "nixl" else 1  # nixl: granted, its one transfer not yet posted
    layout = small_layout()
    source = random_pool(layout, 16, seed=2)
    receiver = make_receiver(kind, layout, 32, config=SMALL_GROUPS)
    sender = make_sender(kind, source, layout, SMALL_GROUPS)
    frozen, go = threading.Event(), threading.Event()

    def freeze(request_id: str, group: int) -> None:
        if group == cut:
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
        if cut:
            assert torch.equal(blocks(receiver.kv_cache, (3, 4))[0], blocks(source, (5, 6))[0])
        assert not blocks(receiver.kv_cache, (3, 4))[cut:].any()  # nothing after the stall
        receiver.expect("other", (4, 9), 2, _deadline())  # reusable now
    finally:
        go.set()
        sender.close()
        receiver.close()


@pytest.mark.parametrize("kind", ["shm", NIXL])
def test_killed_sender_releases_its_claims(kind: str) -> None:
    """A sender process frozen mid-write (SIGSTOP) keeps the blocks quarantined; once it
    is killed its claims are cleared and the lease ends."""
    layout = small_layout()
    receiver = make_receiver(kind, layout, 32, config=SMALL_GROUPS)
    peer = None
    stall = 0 if kind == "nixl" else 2  # nixl: granted, its one transfer not yet posted
    try:
        desc = receiver.expect("r", (7, 8, 9), 1, _deadline())
        peer = spawn_peer(
            "send",
            "--kind",
            kind,
            "--seed",
            "3",
            "--src",
            "1,2,3",
            "--descriptor",
            descriptor_to_json(desc),
            "--stall-at-group",
            str(stall),
        )
        assert read_json_line(peer, 30) == {"stalled_at": stall}
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


_RUN_A_SENDER = """
import sys, time
from engine.transfer.factory import make_sender
from engine.transfer.writer_liveness import writer_id
from tests.transfer_peer import random_pool, small_layout
sender = make_sender("shm", random_pool(small_layout(), 4, seed=1), small_layout())
print(writer_id(sender.incarnation), flush=True)
if sys.argv[1] == "stay":
    time.sleep(3600)
"""  # "exit": ends without closing the sender


def _sender_process(mode: str) -> tuple[subprocess.Popen[str], str]:
    """A process with an shm sender, and the path of the sender's lock file."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_A_SENDER, mode],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    return proc, _lock_path(int(proc.stdout.readline()))


def _lock_path(wid: int) -> str:
    return f"/dev/shm/baton_tx_{wid:016x}"


def test_sender_lock_file_goes_when_its_process_exits() -> None:
    proc, path = _sender_process("exit")
    try:
        assert proc.wait(30) == 0
        assert not os.path.exists(path)
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_stale_writer_lock_files_are_swept_when_a_sender_starts() -> None:
    """A sender killed outright leaves its lock file; the next sender to start removes
    it, and leaves alone the files that live senders hold."""
    stale, stale_path = _sender_process("stay")
    live = WriterLock(os.urandom(16).hex())
    try:
        os.kill(stale.pid, signal.SIGKILL)
        stale.wait(10)
        assert os.path.exists(stale_path)
        layout = small_layout()
        make_sender("shm", random_pool(layout, 4, seed=1), layout).close()
        assert not os.path.exists(stale_path)
        assert os.path.exists(_lock_path(live.id)) and writer_alive(live.id)
    finally:
        live.close()
        if stale.poll() is None:
            stale.kill()
            stale.wait(5)
        if stale.stdout is not None:
            stale.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale_path)


# -- stale peer state ------------------------------------------------------------------------


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(name in line for line in maps)


@pytest.mark.parametrize("kind", ["shm", "gloo", NIXL])
def test_sender_drops_the_state_of_a_receiver_that_died(kind: str) -> None:
    """A decode worker dies (SIGKILL) and never comes back: within seconds the prefill
    side holds no link to it, and for shm no mapping of its pool."""
    import gc

    from tests.transfer_peer import descriptor_from_json

    layout = small_layout()
    source = random_pool(layout, 16, seed=4)
    sender = make_sender(kind, source, layout, SMALL_GROUPS)
    peer = spawn_peer("receive", "--kind", kind, "--seed", "4", "--src", "3,4", "--dst", "1,2")
    try:
        desc = descriptor_from_json(read_json_line(peer, 30)["descriptor"])
        sender.submit(SendJob(desc.request_id, (3, 4), desc, _deadline()))
        assert wait_for(sender.poll).ok
        assert sender.num_links == 1
        name = desc.endpoint.address
        if kind == "shm":
            assert _mapped(name)
        peer.kill()
        peer.wait(10)
        end = time.monotonic() + 10
        while sender.num_links and time.monotonic() < end:
            time.sleep(0.05)
        assert sender.num_links == 0
        if kind == "shm":
            gc.collect()
            assert not _mapped(name)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(5)
        for pipe in (peer.stdin, peer.stdout):
            if pipe is not None:
                pipe.close()
        sender.close()


def test_idle_links_and_pairs_are_dropped_and_rebuilt() -> None:
    from engine.transfer.base import TransferConfig

    quick = TransferConfig(
        group_bytes=1, connect_timeout_s=10.0, stall_timeout_s=2.0, peer_idle_s=0.5
    )
    layout = small_layout()
    source = random_pool(layout, 16, seed=5)
    receiver = make_receiver("gloo", layout, 32, config=quick)
    sender = make_sender("gloo", source, layout, quick)
    try:
        for attempt in range(2):
            desc = receiver.expect(f"r{attempt}", (1, 2), 1, _deadline())
            sender.submit(SendJob(f"r{attempt}", (3, 4), desc, _deadline()))
            sent = wait_for(sender.poll)
            assert sent.ok, sent.error
            receiver.verify(f"r{attempt}", sent.checksum or 0, 1)
            assert wait_for(receiver.poll).ok
            assert receiver.num_pairs == 1 and sender.num_links == 1
            end = time.monotonic() + 8
            while (receiver.num_pairs or sender.num_links) and time.monotonic() < end:
                time.sleep(0.05)
            # Idle past the bound: the sender let go first, then the receiver.
            assert sender.num_links == 0 and receiver.num_pairs == 0
    finally:
        sender.close()
        receiver.close()


def test_receiver_forgets_a_departed_sender() -> None:
    layout = small_layout()
    source = random_pool(layout, 16, seed=6)
    receiver = make_receiver("gloo", layout, 32, config=SMALL_GROUPS)
    sender = make_sender("gloo", source, layout, SMALL_GROUPS)
    try:
        desc = receiver.expect("r", (1, 2), 1, _deadline())
        sender.submit(SendJob("r", (3, 4), desc, _deadline()))
        assert wait_for(sender.poll).ok
        assert receiver.num_pairs == 1
        receiver.forget_sender(sender.incarnation)
        end = time.monotonic() + 5
        while receiver.num_pairs and time.monotonic() < end:
            time.sleep(0.05)
        assert receiver.num_pairs == 0
    finally:
        sender.close()
        receiver.close()
