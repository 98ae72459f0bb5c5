"""The gloo rendezvous against anyone who can reach the receiver's store.

The store is a plain TCP key-value store. A client that takes a hello number and never
says hello (or a sender that dies between the two) must not hold up the senders behind
it; and with a fleet secret, every value a peer reads there (the receiver's incarnation
and layout, the verdict, the readiness, the process group's rank addresses) is checked,
so a forged one is never acted on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from engine.errors import PermissionDeniedError
from engine.transfer import pair_group
from engine.transfer.base import KVReceiver, KVSender, SendJob, TransferConfig
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.store_protocol import KEY_HELLO_COUNT, KEY_INCARNATION, verdict_key
from tests.transfer_peer import (
    SMALL_GROUPS,
    blocks,
    random_pool,
    small_layout,
    transfer_threads,
    wait_for,
)

KEYED = dataclasses.replace(SMALL_GROUPS, fleet_key=FleetKey(b"fleet-secret-0123456789abcdef"))


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    """No transport thread outlives its closed owner (gloo makes no shm segments, and
    other processes' may come and go meanwhile)."""
    yield
    end = time.monotonic() + 5
    while transfer_threads() and time.monotonic() < end:
        time.sleep(0.01)
    assert transfer_threads() == []


def intruder(receiver: KVReceiver) -> dist.TCPStore:
    """A plain store client of the receiver's rendezvous: no secret, no process group."""
    host, port = receiver.endpoint.address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), None, False, timedelta(seconds=5))


def transfer(sender: KVSender, receiver: KVReceiver, rid: str, timeout: float) -> None:
    """One transfer that must land and verify within ``timeout`` seconds."""
    began = time.monotonic()
    desc = receiver.expect(rid, (5, 6), 2, began + 60)
    sender.submit(SendJob(rid, (3, 4), desc, began + 60))
    sent = wait_for(sender.poll, 60)
    assert sent.ok, sent.error
    assert time.monotonic() - began < timeout
    receiver.verify(rid, sent.checksum or 0, 2)
    assert wait_for(receiver.poll, 20).ok


def test_a_hello_number_taken_and_never_used_holds_up_no_sender() -> None:
    layout = small_layout()
    source = random_pool(layout, 16, seed=9)
    receiver = make_receiver("gloo", layout, 32, config=SMALL_GROUPS)
    sender = make_sender("gloo", source, layout, SMALL_GROUPS)
    store = intruder(receiver)
    try:
        store.add(KEY_HELLO_COUNT, 1)  # and then nothing: no hello, ever
        # Well inside the connect timeout (10 s) the abandoned number waits for.
        transfer(sender, receiver, "behind", SMALL_GROUPS.connect_timeout_s / 2)
        assert bool((blocks(receiver.kv_cache, (5, 6)) == blocks(source, (3, 4))).all())
    finally:
        sender.close()
        receiver.close()
        del store


def test_a_hello_number_left_unused_is_given_up_after_the_connect_timeout() -> None:
    quick = TransferConfig(group_bytes=1, connect_timeout_s=1.0, stall_timeout_s=2.0)
    receiver = make_receiver("gloo", small_layout(), 8, config=quick)
    store = intruder(receiver)
    try:
        n = store.add(KEY_HELLO_COUNT, 1)
        time.sleep(quick.connect_timeout_s * 3)
        # A hello under the given-up number is never answered.
        from engine.transfer.store_protocol import KEY_HELLO_BELL, Hello, hello_key

        store.set(hello_key(n), Hello("late", small_layout()).to_bytes())
        store.set(KEY_HELLO_BELL, b"1")
        with pytest.raises(dist.DistStoreError):
            store.wait([verdict_key(n)], timedelta(seconds=1.0))
    finally:
        receiver.close()
        del store


def test_with_a_fleet_secret_a_forged_verdict_is_waited_past() -> None:
    layout = small_layout()
    source = random_pool(layout, 16, seed=9)
    receiver = make_receiver("gloo", layout, 32, config=KEYED)
    sender = make_sender("gloo", source, layout, KEYED)
    store = intruder(receiver)
    try:
        # The next hello's verdict, written before the sender even asks: a refusal.
        n = store.add(KEY_HELLO_COUNT, 0) + 1
        store.set(verdict_key(n), b"refused: KV layout differs (forged)")
        transfer(sender, receiver, "member", 20)
        assert bool((blocks(receiver.kv_cache, (5, 6)) == blocks(source, (3, 4))).all())
    finally:
        sender.close()
        receiver.close()
        del store


def test_with_a_fleet_secret_an_unsealed_receiver_record_is_refused() -> None:
    layout = small_layout()
    receiver = make_receiver("gloo", layout, 32, config=KEYED)
    sender = make_sender("gloo", random_pool(layout, 16, seed=9), layout, KEYED)
    store = intruder(receiver)
    try:
        # The right incarnation, written by someone without the secret (a store squatted
        # by a process that took over the address would say the same).
        store.set(KEY_INCARNATION, receiver.endpoint.incarnation)
        desc = receiver.expect("r", (1,), 1, time.monotonic() + 30)
        sender.submit(SendJob("r", (0,), desc, time.monotonic() + 30))
        failed = wait_for(sender.poll, 30)
        assert isinstance(failed.error, PermissionDeniedError), failed
        assert "incarnation record" in str(failed.error)
        assert receiver.num_pairs == 0
    finally:
        sender.close()
        receiver.close()
        del store


def test_the_rendezvous_of_a_pair_group_is_sealed() -> None:
    """Gloo's rank addresses and NCCL's unique id go through this store: a value written
    without the secret, or sealed for another key, is refused before any connect."""
    key = FleetKey(b"fleet-secret-0123456789abcdef")
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    # A forged value is waited past for the connect timeout, then refused.
    config = dataclasses.replace(SMALL_GROUPS, fleet_key=key, connect_timeout_s=0.2)
    sealed = pair_group.rendezvous_store(server, "baton/pair/a/b/1/pg", config)
    sealed.set("0/0", b"address of rank 0")
    assert sealed.get("0/0") == b"address of rank 0"
    raw = dist.PrefixStore("baton/pair/a/b/1/pg", server)
    assert raw.get("0/0") != b"address of rank 0"  # stored sealed
    raw.set("0/0", b"the intruder's address")
    with pytest.raises(PermissionDeniedError):
        sealed.get("0/0")
    # Overwritten by the genuine writer while the reader waits: the reader gets it.
    threading.Timer(0.05, sealed.set, ("0/0", b"address of rank 0")).start()
    assert sealed.get("0/0") == b"address of rank 0"
    raw.set("0/1", raw.get("0/0"))  # a genuine value replayed under another key
    with pytest.raises(PermissionDeniedError):
        sealed.get("0/1")
    other_pair = pair_group.rendezvous_store(server, "baton/pair/a/b/2/pg", config)
    other_pair.set("0/0", b"rank 0 of pair 2")
    dist.PrefixStore("baton/pair/a/b/1/pg", server).set(
        "0/0", dist.PrefixStore("baton/pair/a/b/2/pg", server).get("0/0")
    )
    with pytest.raises(PermissionDeniedError):
        sealed.get("0/0")  # replayed from another pair
    del server
