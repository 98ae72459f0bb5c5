"""The fleet's shared secret on the KV path: a process without it cannot join a gloo
receiver's rendezvous (no pair group, no data), a wrong secret is refused the same way,
the right one transfers; and the hand-off records' tags cover everything they commit to.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from engine.errors import PermissionDeniedError
from engine.sampling_params import SamplingParams
from engine.transfer.base import SendJob
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import (
    PrefillOrder,
    TransferDone,
    done_is_signed,
    done_tag,
    order_is_signed,
    order_tag,
)
from tests.transfer_peer import (
    NIXL,
    SMALL_GROUPS,
    blocks,
    descriptor_to_json,
    random_pool,
    read_json_line,
    small_layout,
    spawn_peer,
    wait_for,
)

SECRET = b"fleet-secret-0123456789abcdef"
FLEET = FleetKey(SECRET)
KEYED = dataclasses.replace(SMALL_GROUPS, fleet_key=FLEET)


@pytest.mark.parametrize("kind", ["gloo", NIXL])
def test_a_process_without_the_fleet_secret_cannot_join_the_rendezvous(
    kind: str, tmp_path: Path
) -> None:
    layout = small_layout()
    receiver = make_receiver(kind, layout, 32, config=KEYED)
    try:
        # A separate process that can reach the store but holds no secret.
        desc = receiver.expect("intruder", (1, 2), 3, time.monotonic() + 30)
        peer = spawn_peer(
            "send", "--kind", kind, "--src", "0,1", "--descriptor", descriptor_to_json(desc)
        )
        try:
            sent = read_json_line(peer, 30)
            assert peer.wait(10) == 0
        finally:
            if peer.poll() is None:
                peer.kill()
            for pipe in (peer.stdin, peer.stdout):
                if pipe is not None:
                    pipe.close()
        assert not sent["ok"]
        assert "PermissionDeniedError" in sent["error"] and "fleet's secret" in sent["error"]
        # A sender with the wrong secret cannot verify the receiver's records and never
        # says hello; no pair group.
        wrong = dataclasses.replace(SMALL_GROUPS, fleet_key=FleetKey(b"x" * 32))
        source = random_pool(layout, 16, 1)
        sender = make_sender(kind, source, layout, wrong)
        try:
            sender.submit(SendJob("intruder", (0, 1), desc, time.monotonic() + 20))
            done = wait_for(sender.poll, 20)
        finally:
            sender.close()
        assert not done.ok and isinstance(done.error, PermissionDeniedError)
        assert "fleet's secret" in str(done.error)
        assert receiver.num_pairs == 0
        assert not blocks(receiver.kv_cache, [1, 2]).any(), "nothing may have been written"
        receiver.cancel("intruder")
        assert wait_for(receiver.poll, 20).request_id == "intruder"
        # A sender of the fleet, in its own process: admitted, and its KV lands.
        secret_file = tmp_path / "fleet.secret"
        secret_file.write_bytes(SECRET + b"\n")
        desc = receiver.expect("member", (5, 6), 4, time.monotonic() + 30)
        member = spawn_peer(
            "send",
            "--kind",
            kind,
            "--src",
            "0,1",
            "--seed",
            "7",
            "--descriptor",
            descriptor_to_json(desc),
            "--fleet-secret-file",
            str(secret_file),
        )
        try:
            sent = read_json_line(member, 30)
            assert member.wait(10) == 0
        finally:
            if member.poll() is None:
                member.kill()
            for pipe in (member.stdin, member.stdout):
                if pipe is not None:
                    pipe.close()
        assert sent["ok"], sent["error"]
        receiver.verify("member", sent["checksum"], sent["epoch"])
        arrived = wait_for(receiver.poll, 20)
        assert arrived.request_id == "member" and arrived.ok, arrived.error
        expected = blocks(random_pool(layout, 16, 7), [0, 1])
        assert bool((blocks(receiver.kv_cache, [5, 6]) == expected).all())
    finally:
        receiver.close()


def _order() -> PrefillOrder:
    receiver = make_receiver("shm", small_layout(), 8)
    try:
        desc = receiver.expect("r1", (1, 2, 3), 7, time.monotonic() + 5)
    finally:
        receiver.close()
    params = SamplingParams(max_tokens=4, temperature=0)
    return PrefillOrder("r1", tuple(range(10, 50)), params, desc)


def test_order_tags_cover_the_request_the_prompt_and_the_lease() -> None:
    order = _order()
    signed = dataclasses.replace(order, mac=order_tag(FLEET, order))
    assert order_is_signed(FLEET, signed)
    assert not order_is_signed(FLEET, order)  # no tag
    assert not order_is_signed(FleetKey(b"y" * 32), signed)  # another fleet's
    desc = order.descriptor
    tampered = [
        dataclasses.replace(signed, request_id="r2"),
        dataclasses.replace(signed, prompt_token_ids=(*order.prompt_token_ids[:-1], 1)),
        dataclasses.replace(signed, descriptor=dataclasses.replace(desc, block_ids=(1, 2, 4))),
        dataclasses.replace(signed, descriptor=dataclasses.replace(desc, lease_token=1)),
        dataclasses.replace(
            signed,
            descriptor=dataclasses.replace(
                desc, endpoint=dataclasses.replace(desc.endpoint, address="elsewhere")
            ),
        ),
    ]
    for order_ in tampered:
        assert not order_is_signed(FLEET, order_)


def test_transfer_reports_are_tagged_per_lease() -> None:
    done = TransferDone(checksum=123, epoch=7, num_bytes=4096)
    signed = dataclasses.replace(done, mac=done_tag(FLEET, "r1", 99, done))
    assert done_is_signed(FLEET, "r1", 99, signed)
    assert not done_is_signed(FLEET, "r1", 98, signed)  # another lease
    assert not done_is_signed(FLEET, "r2", 99, signed)
    assert not done_is_signed(FLEET, "r1", 99, dataclasses.replace(signed, checksum=124))
    assert not done_is_signed(FLEET, "r1", 99, done)


def test_the_secret_file_is_checked_and_never_shown(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"too-short")
    with pytest.raises(ValueError, match="--fleet-secret-file.*at least 16 are required"):
        FleetKey.from_file(short)
    with pytest.raises(ValueError, match="cannot be read"):
        FleetKey.from_file(tmp_path / "missing")
    good = tmp_path / "good"
    good.write_bytes(SECRET)
    key = FleetKey.from_file(good)
    assert SECRET.decode() not in repr(key) and SECRET.decode() not in json.dumps(str(key))
