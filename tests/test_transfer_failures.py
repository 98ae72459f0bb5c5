"""The nccl pair logic through its gloo twin when things break.

A peer process killed in the middle of a transfer ends that transfer with a typed error
and nothing else: the survivor, receiver or sender, goes on serving new peers. A
receiver that cannot build its side of a pair group says so, and the sender fails at
once with that reason instead of timing out. And the NCCL settings that keep a failed
pair from killing the process.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from engine.errors import AbortedError, DeadlineExceededError, UnavailableError
from engine.transfer.base import KVReceiver, KVSender, SendJob, TransferConfig
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.nccl import ERROR_HANDLING_VAR, NcclPairGroup
from engine.transfer.pair_group import PairGroup, group_timeout_s
from tests.transfer_peer import (
    SMALL_GROUPS,
    assert_nothing_left_behind,
    blocks,
    descriptor_to_json,
    random_pool,
    read_json_line,
    shm_segments,
    small_layout,
    spawn_peer,
    wait_for,
)

PEER_LOST = (UnavailableError, AbortedError, DeadlineExceededError)
FAST = TransferConfig(group_bytes=1, connect_timeout_s=5.0, stall_timeout_s=4.0)


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    before = shm_segments()
    yield
    assert_nothing_left_behind(before)


def deadline(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def finish(peer) -> None:  # noqa: ANN001 - a Popen
    if peer.poll() is None:
        peer.kill()
    peer.wait(10)
    for pipe in (peer.stdin, peer.stdout):
        if pipe is not None:
            pipe.close()


def send_in_process(
    sender: KVSender, receiver: KVReceiver, rid: str, src: tuple[int, ...], dst: tuple[int, ...]
) -> None:
    """One full transfer that must verify."""
    desc = receiver.expect(rid, dst, 3, deadline())
    sender.submit(SendJob(rid, src, desc, deadline()))
    sent = wait_for(sender.poll, 20)
    assert sent.ok, sent.error
    receiver.verify(rid, sent.checksum, sent.epoch)
    done = wait_for(receiver.poll, 20)
    assert done.ok, done.error


def test_receiver_survives_a_sender_killed_mid_transfer() -> None:
    layout = small_layout()
    receiver = make_receiver("gloo", layout, 32, config=FAST)
    try:
        desc = receiver.expect("doomed", (30, 1, 17, 8), 5, deadline())
        peer = spawn_peer(
            "send",
            "--kind",
            "gloo",
            "--seed",
            "11",
            "--src",
            "3,0,7,12",
            "--descriptor",
            descriptor_to_json(desc),
            "--stall-at-group",
            "1",
        )
        try:
            assert read_json_line(peer, 25) == {"stalled_at": 1}
            peer.kill()  # stalled before layer group 1, group 0 sent
        finally:
            finish(peer)
        ended = wait_for(receiver.poll, 15)
        assert ended.request_id == "doomed" and isinstance(ended.error, PEER_LOST), ended
        # The survivor serves the next sender process as if nothing happened.
        desc = receiver.expect("next", (2, 9), 6, deadline())
        peer = spawn_peer(
            "send",
            "--kind",
            "gloo",
            "--seed",
            "11",
            "--src",
            "5,6",
            "--descriptor",
            descriptor_to_json(desc),
        )
        try:
            sent = read_json_line(peer, 25)
        finally:
            finish(peer)
        assert sent["ok"], sent["error"]
        receiver.verify("next", sent["checksum"], sent["epoch"])
        done = wait_for(receiver.poll, 15)
        assert done.ok, done.error
        source = random_pool(layout, 16, seed=11)
        assert torch.equal(blocks(receiver.kv_cache, (2, 9)), blocks(source, (5, 6)))
    finally:
        receiver.close()


def test_sender_survives_a_receiver_killed_mid_transfer() -> None:
    layout = small_layout()
    source = random_pool(layout, 16, seed=11)
    sender = make_sender("gloo", source, layout, FAST)
    peer = spawn_peer(
        "receive",
        "--kind",
        "gloo",
        "--seed",
        "11",
        "--src",
        "3,0,7,12",
        "--dst",
        "30,1,17,8",
        "--epoch",
        "5",
    )
    try:
        desc = read_json_line(peer, 25)["descriptor"]
        from tests.transfer_peer import descriptor_from_json

        at_group_1 = []

        def slow(request_id: str, group: int) -> None:
            if group == 1 and not at_group_1:
                at_group_1.append(request_id)
                peer.kill()  # the receiver dies with group 0 sent
                peer.wait(10)

        sender._on_group = slow  # type: ignore[attr-defined]
        sender.submit(SendJob("req-x", (3, 0, 7, 12), descriptor_from_json(desc), deadline()))
        failed = wait_for(sender.poll, 20)
        assert at_group_1 == ["req-x"]
        assert not failed.ok and isinstance(failed.error, PEER_LOST), failed
    finally:
        finish(peer)
    try:
        sender._on_group = None  # type: ignore[attr-defined]
        other = make_receiver("gloo", layout, 32, config=FAST)
        try:
            send_in_process(sender, other, "after", (4, 5), (6, 7))
            assert torch.equal(blocks(other.kv_cache, (6, 7)), blocks(source, (4, 5)))
        finally:
            other.close()
    finally:
        sender.close()


class BreaksOnce(PairGroup):
    """The receiver's side of the first pair fails after the group was built, the way
    NCCL's communicator setup or ``set_device`` on the pair thread would."""

    def __init__(self) -> None:
        self.failures = 1

    def handshake(
        self,
        pg: dist.ProcessGroup,
        timeout_s: float,
        what: str,
        give_up: Callable[[], str | None] | None = None,
    ) -> None:
        if self.failures:
            self.failures -= 1
            raise ValueError("device cuda: expected an indexed device")
        super().handshake(pg, timeout_s, what, give_up)


def test_a_pair_the_receiver_cannot_build_fails_the_send_at_once_with_its_reason() -> None:
    layout = small_layout()
    # A handshake timeout far beyond the wait the answer allows, so that a slow machine's
    # group set-up (seconds under load) cannot pass for the answer or the timeout.
    patient = dataclasses.replace(FAST, connect_timeout_s=60.0)
    receiver = make_receiver("gloo", layout, 32, config=patient)
    receiver.pair_group = BreaksOnce()  # type: ignore[attr-defined]
    source = random_pool(layout, 16, seed=2)
    sender = make_sender("gloo", source, layout, patient)
    try:
        desc = receiver.expect("first", (1,), 1, deadline())
        started = time.monotonic()
        sender.submit(SendJob("first", (0,), desc, deadline()))
        failed = wait_for(sender.poll, 20)
        assert isinstance(failed.error, UnavailableError), failed
        assert "could not build pair" in str(failed.error)
        assert "indexed device" in str(failed.error)
        # Not the handshake's timeout: the receiver's answer ended the wait.
        assert time.monotonic() - started < patient.connect_timeout_s / 3
        receiver.cancel("first")
        assert wait_for(receiver.poll).request_id == "first"
        send_in_process(sender, receiver, "second", (3, 4), (5, 6))
        assert torch.equal(blocks(receiver.kv_cache, (5, 6)), blocks(source, (3, 4)))
    finally:
        sender.close()
        receiver.close()


def test_nccl_group_timeout_outlasts_every_wait_of_ours() -> None:
    for config in (TransferConfig(), FAST, SMALL_GROUPS):
        assert group_timeout_s(config) > config.stall_timeout_s
        assert group_timeout_s(config) > config.connect_timeout_s


def test_nccl_errors_end_the_pair_not_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ERROR_HANDLING_VAR, "3")  # PyTorch's default: tear the process down
    NcclPairGroup(torch.device("cuda", 0))
    assert os.environ[ERROR_HANDLING_VAR] == "2"


def test_nccl_needs_an_indexed_device() -> None:
    with pytest.raises(ValueError, match=r"indexed CUDA device \(cuda:N\)"):
        NcclPairGroup(torch.device("cuda"))
    with pytest.raises(ValueError, match="indexed CUDA device"):
        NcclPairGroup(torch.device("cpu"))
