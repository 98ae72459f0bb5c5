"""KV round trips through the CPU transports (shm, gloo): in one process, across two
independently started processes, and across a receiver restart; closing leaves no
thread or shared-memory segment behind."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.errors import DeadlineExceededError, UnavailableError
from engine.kv_layout import KVLayout
from engine.transfer.base import (
    KVReceiver,
    KVSender,
    RecvCompletion,
    SendCompletion,
    SendJob,
    TransferConfig,
)
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.nixl_wire import PoolHandle
from tests.transfer_peer import (
    NIXL,
    SMALL_GROUPS,
    assert_nothing_left_behind,
    blocks,
    cross_process_transfer,
    random_pool,
    shm_segments,
    small_layout,
    transfer_threads,
    wait_for,
)

KINDS = ("shm", "gloo", NIXL)


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    before = shm_segments()
    yield
    assert_nothing_left_behind(before)


@contextmanager
def connected(
    kind: str,
    layout: KVLayout,
    seed: int = 0,
    config: TransferConfig = SMALL_GROUPS,
    address: str | None = None,
) -> Iterator[tuple[KVSender, KVReceiver, torch.Tensor]]:
    receiver = make_receiver(kind, layout, 32, address=address, config=config)
    source = random_pool(layout, 16, seed)
    sender = make_sender(kind, source, layout, config)
    try:
        yield sender, receiver, source
    finally:
        sender.close()
        receiver.close()


def transfer(
    sender: KVSender,
    receiver: KVReceiver,
    request_id: str,
    src: tuple[int, ...],
    dst: tuple[int, ...],
    epoch: int = 3,
) -> tuple[SendCompletion, RecvCompletion]:
    desc = receiver.expect(request_id, dst, epoch, time.monotonic() + 10)
    sender.submit(SendJob(request_id, src, desc, time.monotonic() + 10))
    sent = wait_for(sender.poll)
    assert sent.ok, sent.error
    receiver.verify(request_id, sent.checksum or 0, sent.epoch)
    return sent, wait_for(receiver.poll)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_moves_exact_bytes_between_random_blocks(kind: str, dtype: str) -> None:
    rng = random.Random(f"{kind}-{dtype}")
    layout = small_layout(dtype)
    with connected(kind, layout) as (sender, receiver, source):
        free = list(range(32))
        rng.shuffle(free)
        written: list[int] = []
        for i in range(3):
            n = rng.randint(1, 6)
            src = tuple(rng.sample(range(16), n))
            dst = tuple(free.pop() for _ in range(n))
            sent, done = transfer(sender, receiver, f"req-{i}", src, dst)
            assert done.ok, done.error
            assert (done.request_id, done.epoch) == (f"req-{i}", 3)
            assert sent.num_bytes == n * layout.block_bytes
            assert torch.equal(blocks(receiver.kv_cache, dst), blocks(source, src))
            written += dst
        untouched = [b for b in range(32) if b not in written]
        assert not blocks(receiver.kv_cache, untouched).any()


@pytest.mark.parametrize("kind", KINDS)
def test_cross_process_transfer_lands_and_verifies(kind: str) -> None:
    sent, received = cross_process_transfer(kind, "bfloat16")
    assert sent["ok"], sent["error"]
    assert sent["epoch"] == 5
    assert sent["num_bytes"] == 4 * small_layout("bfloat16").block_bytes
    assert received["ok"], received["error"]
    assert received["data_ok"]


@pytest.mark.parametrize("kind", KINDS)
def test_restarted_receiver_at_same_address_gets_fresh_sender_state(kind: str) -> None:
    layout = small_layout()
    source = random_pool(layout, 16, seed=4)
    sender = make_sender(kind, source, layout, SMALL_GROUPS)
    address = f"baton_kv_test_{uuid.uuid4().hex[:12]}" if kind == "shm" else "127.0.0.1:0"
    first = make_receiver(kind, layout, 32, address=address, config=SMALL_GROUPS)
    try:
        assert transfer(sender, first, "a", (1, 2), (3, 4))[1].ok
        stale = first.expect("stale", (9,), 1, time.monotonic() + 10)
        address = first.endpoint.address
        first.close()
        second = make_receiver(kind, layout, 32, address=address, config=SMALL_GROUPS)
        try:
            assert second.endpoint.address == address
            assert second.incarnation != first.incarnation
            _, done = transfer(sender, second, "b", (5, 6), (7, 8))
            assert done.ok, done.error
            assert torch.equal(blocks(second.kv_cache, (7, 8)), blocks(source, (5, 6)))
            # A descriptor from the dead incarnation is refused, never written.
            sender.submit(SendJob("stale", (0,), stale, time.monotonic() + 5))
            refused = wait_for(sender.poll)
            if kind == "nixl":
                # The descriptor itself carries the dead agent's metadata: nothing at the
                # address says who lives there now, so the dead agent just never answers.
                assert isinstance(refused.error, UnavailableError | DeadlineExceededError)
            else:
                assert isinstance(refused.error, UnavailableError)
                assert "restarted" in str(refused.error)
            assert not blocks(second.kv_cache, (9,)).any()
        finally:
            second.close()
    finally:
        sender.close()
        first.close()
    if kind == "shm":
        assert address not in shm_segments()


def test_shm_sender_survives_a_closed_receiver() -> None:
    layout = small_layout()
    with connected("shm", layout) as (sender, receiver, _):
        assert transfer(sender, receiver, "a", (1,), (2,))[1].ok
        desc = receiver.expect("b", (5,), 1, time.monotonic() + 10)
        receiver.close()
        sender.submit(SendJob("b", (1,), desc, time.monotonic() + 5))
        failed = wait_for(sender.poll)
        assert isinstance(failed.error, UnavailableError)
        with connected("shm", layout) as (_, other, _):
            _, done = transfer(sender, other, "c", (3,), (4,))
            assert done.ok, done.error


@pytest.mark.parametrize("kind", KINDS)
def test_close_fails_pending_work_and_joins_threads(kind: str) -> None:
    layout = small_layout()
    with connected(kind, layout) as (sender, receiver, _):
        gate = threading.Event()
        sender._on_group = lambda request_id, group: gate.wait(10)  # type: ignore[attr-defined]
        first = receiver.expect("first", (1,), 1, time.monotonic() + 30)
        queued = receiver.expect("queued", (2,), 1, time.monotonic() + 30)
        sender.submit(SendJob("first", (0,), first, time.monotonic() + 30))
        sender.submit(SendJob("queued", (0,), queued, time.monotonic() + 30))
        threading.Timer(0.2, gate.set).start()
        sender.close()
        outcomes = {c.request_id: c.error for c in sender.poll()}
        assert set(outcomes) == {"first", "queued"}
        assert all(isinstance(e, UnavailableError) for e in outcomes.values())
        with pytest.raises(UnavailableError):
            sender.submit(SendJob("first", (0,), first, time.monotonic() + 30))
        receiver.close()
        ended = {c.request_id: c.error for c in receiver.poll()}
        assert set(ended) == {"first", "queued"}
        assert all(isinstance(e, UnavailableError) for e in ended.values())
        receiver.close()  # idempotent
        assert receiver.poll() == []
    assert transfer_threads() == []


@pytest.mark.parametrize("kind", [NIXL])
def test_nixl_moves_a_run_of_blocks_as_one_strided_descriptor(kind: str) -> None:
    layout = small_layout()
    with connected(kind, layout) as (sender, receiver, source):
        handle = PoolHandle.from_bytes(receiver.endpoint.handle)
        local, remote = sender.descriptors((2, 3, 4, 9), (20, 21, 22, 5), handle, 32)  # type: ignore[attr-defined]
        rows = layout.num_layers * 2 * layout.num_kv_heads
        row = layout.block_size * layout.head_dim * 4
        assert local.tolist() == [
            [source.data_ptr() + 2 * row, 3 * row, 0, 16 * row, rows],
            [source.data_ptr() + 9 * row, row, 0, 16 * row, rows],
        ]
        assert remote.tolist() == [
            [handle.address + 20 * row, 3 * row, 0, 32 * row, rows],
            [handle.address + 5 * row, row, 0, 32 * row, rows],
        ]
        _, done = transfer(sender, receiver, "run", (2, 3, 4, 9), (20, 21, 22, 5))
        assert done.ok, done.error
        assert torch.equal(blocks(receiver.kv_cache, (20, 21, 22, 5)), blocks(source, (2, 3, 4, 9)))
