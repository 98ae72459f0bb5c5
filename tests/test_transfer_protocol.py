"""The hand-off protocol rules the transports enforce (DESIGN "KV ownership"): layout
handshake, checksum and epoch integrity, cancel at every stage, deadlines, and input
validation. Sender and receiver run in this process on their own threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import xxhash

from engine.errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    LayoutMismatchError,
)
from engine.kv_layout import KVLayout
from engine.transfer import block_copy
from engine.transfer.base import KVReceiver, KVSender, SendJob, TransferConfig
from engine.transfer.block_copy import Staging, checksum_blocks
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.store_protocol import (
    KEY_HELLO_BELL,
    KEY_HELLO_COUNT,
    Hello,
    JobHeader,
    hello_key,
    verdict_key,
)
from tests.transfer_peer import (
    NIXL,
    SMALL_GROUPS,
    assert_nothing_left_behind,
    blocks,
    random_pool,
    shm_segments,
    small_layout,
    wait_for,
)

KINDS = ("shm", "gloo", NIXL)
SOON = 10.0


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    before = shm_segments()
    yield
    assert_nothing_left_behind(before)


@contextmanager
def connected(
    kind: str,
    layout: KVLayout | None = None,
    sender_layout: KVLayout | None = None,
    config: TransferConfig = SMALL_GROUPS,
) -> Iterator[tuple[KVSender, KVReceiver, torch.Tensor]]:
    layout = layout or small_layout()
    sender_layout = sender_layout or layout
    receiver = make_receiver(kind, layout, 32, config=config)
    source = random_pool(sender_layout, 16, seed=7)
    sender = make_sender(kind, source, sender_layout, config)
    try:
        yield sender, receiver, source
    finally:
        sender.close()
        receiver.close()


def deadline(seconds: float = SOON) -> float:
    return time.monotonic() + seconds


# -- layout handshake ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_descriptor_with_another_layout_is_refused_at_submit(kind: str) -> None:
    with connected(kind, small_layout(head_dim=16), sender_layout=small_layout()) as (
        sender,
        receiver,
        _,
    ):
        desc = receiver.expect("r", (1,), 1, deadline())
        with pytest.raises(LayoutMismatchError, match=r"head_dim: 8 != 16"):
            sender.submit(SendJob("r", (0,), desc, deadline()))


@pytest.mark.parametrize("kind", KINDS)
def test_live_peer_with_another_layout_is_refused_at_connect(kind: str) -> None:
    theirs = small_layout("bfloat16", num_layers=6)
    with connected(kind, theirs, sender_layout=small_layout()) as (sender, receiver, _):
        desc = receiver.expect("r", (1,), 1, deadline())
        # A descriptor that lies about the layout still meets the live receiver's.
        forged = replace(desc, endpoint=replace(desc.endpoint, layout=small_layout()))
        sender.submit(SendJob("r", (0,), forged, deadline()))
        failed = wait_for(sender.poll)
        assert isinstance(failed.error, LayoutMismatchError)
        message = str(failed.error)
        assert "num_layers: 4 != 6" in message and "'float32' != 'bfloat16'" in message
        assert not receiver.kv_cache.any()


@pytest.mark.parametrize("kind", KINDS)
def test_live_peer_in_the_other_numerics_mode_is_refused_at_connect(kind: str) -> None:
    """A deterministic worker and a default one compute other KV bits for the same
    tokens: each transport's own layout record carries the mode, so the live receiver
    refuses the mix even when the descriptor says otherwise."""
    theirs = replace(small_layout(), deterministic=True)
    with connected(kind, theirs, sender_layout=small_layout()) as (sender, receiver, _):
        desc = receiver.expect("r", (1,), 1, deadline())
        forged = replace(desc, endpoint=replace(desc.endpoint, layout=small_layout()))
        sender.submit(SendJob("r", (0,), forged, deadline()))
        failed = wait_for(sender.poll)
        assert isinstance(failed.error, LayoutMismatchError)
        assert "deterministic: False != True" in str(failed.error)
        assert not receiver.kv_cache.any()


def test_gloo_receiver_refuses_a_hello_with_another_layout() -> None:
    receiver = make_receiver("gloo", small_layout(), 8, config=SMALL_GROUPS)
    try:
        host, port = receiver.endpoint.address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=5))
        n = store.add(KEY_HELLO_COUNT, 1)
        store.set(hello_key(n), Hello("intruder", small_layout(head_dim=4)).to_bytes())
        store.set(KEY_HELLO_BELL, b"1")
        store.wait([verdict_key(n)], timedelta(seconds=5))
        verdict = store.get(verdict_key(n)).decode()
        assert "refused" in verdict and "head_dim: 8 != 4" in verdict
        del store
    finally:
        receiver.close()


# -- integrity -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_checksum_and_corrupted_blocks_are_aborted(kind: str) -> None:
    with connected(kind) as (sender, receiver, _):
        for request_id, corrupt in (("wrong-sum", False), ("bit-flip", True)):
            desc = receiver.expect(request_id, (4, 5), 2, deadline())
            sender.submit(SendJob(request_id, (1, 2), desc, deadline()))
            sent = wait_for(sender.poll)
            assert sent.ok and sent.checksum is not None
            checksum = sent.checksum
            if corrupt:
                receiver.kv_cache[1, 1, 0, 5, 2, 3] += 1.0
            else:
                checksum ^= 1
            receiver.verify(request_id, checksum, 2)
            done = wait_for(receiver.poll)
            assert isinstance(done.error, AbortedError)
            assert "checksum mismatch" in str(done.error)


@pytest.mark.parametrize("kind", KINDS)
def test_epoch_mismatch_at_verify_is_aborted(kind: str) -> None:
    with connected(kind) as (sender, receiver, _):
        desc = receiver.expect("r", (4,), 7, deadline())
        sender.submit(SendJob("r", (1,), desc, deadline()))
        sent = wait_for(sender.poll)
        receiver.verify("r", sent.checksum or 0, 8)
        done = wait_for(receiver.poll)
        assert isinstance(done.error, AbortedError)
        assert "epoch 8" in str(done.error)


@pytest.mark.parametrize("kind", ["gloo", NIXL])
def test_data_for_another_epoch_never_lands(kind: str) -> None:
    with connected(kind) as (sender, receiver, _):
        desc = receiver.expect("r", (4,), 7, deadline())
        sender.submit(SendJob("r", (1,), replace(desc, epoch=6), deadline()))
        sent = wait_for(sender.poll)
        if kind == "nixl":  # refused at the claim: nothing is ever posted
            assert isinstance(sent.error, AbortedError) and "epoch 6" in str(sent.error)
        else:  # gloo sends; the receiver drops the data
            assert sent.ok
        done = wait_for(receiver.poll)
        assert isinstance(done.error, AbortedError) and "epoch 6" in str(done.error)
        assert not receiver.kv_cache.any()


def test_checksum_does_not_depend_on_layer_grouping() -> None:
    layout = small_layout("bfloat16", num_layers=5)
    pool = random_pool(layout, 8, seed=1)
    sums = {checksum_blocks(pool, layout, (3, 1, 6), size, Staging()) for size in (1, 700, 1 << 30)}
    assert len(sums) == 1


def test_checksum_is_xxh3_of_the_wire_bytes_however_they_are_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = small_layout("bfloat16", num_layers=5)
    pool = random_pool(layout, 8, seed=1)
    ids = (3, 4, 1, 6)  # a run (3, 4) and two single blocks
    wire = blocks(pool, ids).contiguous().view(-1).view(torch.uint8).numpy()
    expected = xxhash.xxh3_64_intdigest(wire)
    for piece in (1, 100, 1 << 30):  # rows per staging piece: one, a few, all
        monkeypatch.setattr(block_copy, "PIECE_BYTES", piece)
        for group_bytes in (1, 700, 1 << 30):
            assert checksum_blocks(pool, layout, ids, group_bytes, Staging()) == expected
    assert checksum_blocks(pool, layout, (4, 3, 1, 6), 1, Staging()) != expected


def test_checksum_sees_one_flipped_byte_anywhere_in_the_leased_blocks() -> None:
    layout = small_layout("bfloat16", num_layers=2, head_dim=4)
    pool = random_pool(layout, 6, seed=3)
    ids = (4, 1, 2)
    expected = checksum_blocks(pool, layout, ids, 1, Staging())
    raw = pool.view(torch.uint8)  # the same memory, one byte per element of the last dim
    leased = torch.zeros(raw.shape, dtype=torch.bool)
    leased[:, :, :, list(ids)] = True
    positions = leased.nonzero().tolist()
    assert len(positions) == len(ids) * layout.block_bytes
    for pos in positions:
        raw[tuple(pos)] ^= 0x10
        assert checksum_blocks(pool, layout, ids, 1, Staging()) != expected, pos
        raw[tuple(pos)] ^= 0x10
    # Bytes outside the lease are not covered.
    raw[:, :, :, 0] ^= 0xFF
    assert checksum_blocks(pool, layout, ids, 1, Staging()) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_sender_checksum_does_not_depend_on_group_bytes(
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = small_layout("bfloat16")
    reported = set()
    for group_bytes, piece in ((1, 1), (700, 1 << 20), (1 << 30, 300)):
        monkeypatch.setattr(block_copy, "PIECE_BYTES", piece)
        config = replace(SMALL_GROUPS, group_bytes=group_bytes)
        with connected(kind, layout, config=config) as (sender, receiver, source):
            desc = receiver.expect("r", (9, 10, 2), 1, deadline())
            sender.submit(SendJob("r", (4, 5, 0), desc, deadline()))
            sent = wait_for(sender.poll)
            assert sent.ok, sent.error
            receiver.verify("r", sent.checksum or 0, 1)
            assert wait_for(receiver.poll).ok
            assert sent.checksum == checksum_blocks(source, layout, (4, 5, 0), 1, Staging())
            reported.add(sent.checksum)
    assert len(reported) == 1


# -- cancel --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_cancel_before_transfer_discards_late_data(kind: str) -> None:
    with connected(kind) as (sender, receiver, _):
        desc = receiver.expect("r", (4, 9), 1, deadline())
        receiver.cancel("r")
        receiver.cancel("r")  # twice is harmless
        ended = wait_for(receiver.poll)
        assert isinstance(ended.error, CancelledError)
        sender.submit(SendJob("r", (1, 2), desc, deadline()))
        sent = wait_for(sender.poll)
        if kind == "shm":  # the sender sees the revoked lease and writes nothing
            assert isinstance(sent.error, AbortedError) and "revoked" in str(sent.error)
        time.sleep(0.05)
        assert not receiver.kv_cache.any()
        assert receiver.poll() == []


@pytest.mark.parametrize("kind", KINDS)
def test_sender_cancel_drops_a_queued_job(kind: str) -> None:
    with connected(kind) as (sender, receiver, _):
        gate = threading.Event()
        sender._on_group = lambda request_id, group: gate.wait(10)  # type: ignore[attr-defined]
        first = receiver.expect("first", (1,), 1, deadline())
        second = receiver.expect("second", (2,), 1, deadline())
        sender.submit(SendJob("first", (0,), first, deadline()))
        sender.submit(SendJob("second", (0,), second, deadline()))
        sender.cancel("second")
        cancelled = wait_for(sender.poll)
        assert cancelled.request_id == "second" and isinstance(cancelled.error, CancelledError)
        gate.set()
        assert wait_for(sender.poll).ok
        assert not blocks(receiver.kv_cache, (2,)).any()


@pytest.mark.parametrize("kind", KINDS)
def test_sender_cancel_mid_transfer_stops_at_a_layer_group(kind: str) -> None:
    # nixl moves a lease in one transfer: its last stop before writing is "group" 0,
    # granted and not yet posted.
    cut = 0 if kind == "nixl" else 1
    with connected(kind) as (sender, receiver, source):

        def cancel_at_second_group(request_id: str, group: int) -> None:
            if group == cut:
                sender.cancel(request_id)

        sender._on_group = cancel_at_second_group  # type: ignore[attr-defined]
        desc = receiver.expect("r", (3, 4), 1, deadline())
        sender.submit(SendJob("r", (5, 6), desc, deadline()))
        sent = wait_for(sender.poll)
        assert isinstance(sent.error, CancelledError)
        if kind in ("gloo", "nixl"):  # the abort travels to the receiver and ends the lease
            ended = wait_for(receiver.poll)
            assert isinstance(ended.error, AbortedError) and "aborted" in str(ended.error)
        else:
            receiver.cancel("r")
            assert isinstance(wait_for(receiver.poll).error, CancelledError)
        got = blocks(receiver.kv_cache, (3, 4))
        if cut:
            assert torch.equal(got[0], blocks(source, (5, 6))[0])  # group 0 landed
        assert not got[cut:].any()  # nothing after the cancel


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_cancel_mid_transfer_frees_blocks_for_reuse(kind: str) -> None:
    cut = 0 if kind == "nixl" else 1  # see test_sender_cancel_mid_transfer_...
    with connected(kind) as (sender, receiver, source):
        early: list[object] = []

        def cancel_at_second_group(request_id: str, group: int) -> None:
            if request_id == "r" and group == cut:
                receiver.cancel(request_id)
                time.sleep(0.05)
                early.extend(receiver.poll())

        sender._on_group = cancel_at_second_group  # type: ignore[attr-defined]
        desc = receiver.expect("r", (3, 4), 1, deadline())
        sender.submit(SendJob("r", (5, 6), desc, deadline()))
        sent = wait_for(sender.poll)
        if kind in ("shm", "nixl"):
            # The shm sender holds its claim on the blocks (nixl: its grant): the lease
            # cannot end until the sender has seen the revocation and let go, and then it
            # writes nothing more.
            assert early == []
            assert isinstance(sent.error, AbortedError)
            ended = wait_for(receiver.poll, SMALL_GROUPS.drain_timeout_s / 2)
        else:
            # gloo writes only inside the receiver: the lease ends at once, data is dropped.
            assert sent.ok
            (ended,) = early
        assert isinstance(ended.error, CancelledError)  # type: ignore[attr-defined]
        assert not blocks(receiver.kv_cache, (3, 4))[cut:].any()
        # The same blocks, leased again, take a full transfer.
        desc = receiver.expect("again", (3, 4), 2, deadline())
        sender.submit(SendJob("again", (7, 8), desc, deadline()))
        sent = wait_for(sender.poll)
        receiver.verify("again", sent.checksum or 0, 2)
        assert wait_for(receiver.poll).ok
        assert torch.equal(blocks(receiver.kv_cache, (3, 4)), blocks(source, (7, 8)))


# -- deadlines -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_lease_whose_sender_never_sends_expires(kind: str) -> None:
    with connected(kind) as (_, receiver, _):
        start = time.monotonic()
        receiver.expect("r", (1,), 1, deadline(0.3))
        ended = wait_for(receiver.poll, 5)
        # A stalled peer, not the client's deadline: retryable ABORTED.
        assert isinstance(ended.error, AbortedError) and "stopped making progress" in str(
            ended.error
        )
        assert 0.3 <= time.monotonic() - start < 2.0
        # The expired blocks are free to lease again.
        receiver.expect("r", (1,), 2, deadline())


@pytest.mark.parametrize("kind", KINDS)
def test_extend_keeps_a_progressing_lease_alive(kind: str) -> None:
    with connected(kind) as (_, receiver, _):
        start = time.monotonic()
        receiver.expect("r", (1,), 1, deadline(0.3))
        for _ in range(5):  # a peer reporting progress every 0.15 s
            time.sleep(0.15)
            receiver.extend("r", deadline(0.3))
        assert receiver.poll() == []
        receiver.extend("r", deadline(-1.0))  # never moves a deadline earlier
        ended = wait_for(receiver.poll, 5)
        assert isinstance(ended.error, AbortedError)
        assert time.monotonic() - start >= 0.75 + 0.3


@pytest.mark.parametrize("kind", KINDS)
def test_job_past_its_deadline_is_not_sent(kind: str) -> None:
    with connected(kind) as (sender, receiver, _):
        desc = receiver.expect("r", (1,), 1, deadline())
        sender.submit(SendJob("r", (0,), desc, time.monotonic() - 1))
        assert isinstance(wait_for(sender.poll).error, DeadlineExceededError)
        assert not receiver.kv_cache.any()


# -- validation ----------------------------------------------------------------------------


def test_factory_rejects_unknown_kinds_and_wrong_devices() -> None:
    with pytest.raises(ValueError, match="'rdma'"):
        make_receiver("rdma", small_layout(), 4)
    with pytest.raises(ValueError, match="'rdma'"):
        make_sender("rdma", random_pool(small_layout(), 4, 0), small_layout())
    # Each refusal happens after the receiver started building: nothing may leak.
    for kind in ("cuda_ipc", "nccl"):
        with pytest.raises(ValueError, match="cpu"):
            make_receiver(kind, small_layout(), 4, device="cpu")
    with pytest.raises(ValueError, match="cuda"):
        make_receiver("shm", small_layout(), 4, device="cuda:0")


@pytest.mark.parametrize("kind", KINDS)
def test_bad_leases_and_jobs_raise_value_error(kind: str) -> None:
    with connected(kind) as (sender, receiver, _):
        with pytest.raises(ValueError, match="leave"):
            receiver.expect("r", (32,), 1, deadline())
        with pytest.raises(ValueError, match="repeat"):
            receiver.expect("r", (1, 1), 1, deadline())
        desc = receiver.expect("r", (1, 2), 1, deadline())
        with pytest.raises(ValueError, match="already holds"):
            receiver.expect("r", (3,), 1, deadline())
        with pytest.raises(ValueError, match="already leased"):
            receiver.expect("other", (2,), 1, deadline())
        with pytest.raises(ValueError, match="2 destination blocks"):
            sender.submit(SendJob("r", (0,), desc, deadline()))
        with pytest.raises(ValueError, match=r"source blocks \[16\]"):
            sender.submit(SendJob("r", (0, 16), desc, deadline()))
        with pytest.raises(ValueError, match="request id"):
            sender.submit(SendJob("x", (0, 1), desc, deadline()))


def test_job_header_and_hello_round_trip() -> None:
    header = JobHeader(12, "req-é", 3, 1 << 61, 2, (5, 0, 9))
    assert JobHeader.from_bytes(header.to_bytes()) == header
    hello = Hello("abc", small_layout("bfloat16"))
    assert Hello.from_bytes(hello.to_bytes()) == hello
    with pytest.raises(ValueError):
        JobHeader.from_bytes(b"short")
