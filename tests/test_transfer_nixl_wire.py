"""The nixl transport's wire records: notifications are tagged under the fleet's secret and
refused without it; the endpoint handle round-trips; a lease becomes one strided
descriptor per run of blocks consecutive in both pools. No NIXL needed."""

from __future__ import annotations

import pytest

from engine.transfer.fleet_auth import FleetKey
from engine.transfer.nixl_wire import (
    CLAIM,
    HELLO,
    Hello,
    Message,
    PoolHandle,
    block_runs,
    claim_fields,
    hello_fields,
    parse_claim,
    proof,
)
from tests.transfer_peer import small_layout

KEY = FleetKey(b"k" * 32)


def test_messages_round_trip_and_are_refused_without_the_fleets_tag() -> None:
    msg = Message(CLAIM, "rx", "tx", 1 << 61, claim_fields("req-é", 7, (5, 0, 9)))
    assert Message.decode(msg.encode(None), None) == msg
    assert parse_claim(Message.decode(msg.encode(KEY), KEY)) == ("req-é", 7, (5, 0, 9))
    with pytest.raises(ValueError, match="fleet's secret"):
        Message.decode(msg.encode(None), KEY)  # untagged
    with pytest.raises(ValueError, match="fleet's secret"):
        Message.decode(msg.encode(FleetKey(b"x" * 32)), KEY)  # another fleet's
    forged = bytearray(msg.encode(KEY))
    forged[-40] ^= 1  # a block id, under the tag
    with pytest.raises(ValueError):
        Message.decode(bytes(forged), KEY)
    with pytest.raises(ValueError):
        Message.decode(b"BXN1C\xff\xff", None)  # truncated


def test_hello_carries_metadata_layout_and_liveness() -> None:
    fields = hello_fields(b"\x00md\xff", small_layout("bfloat16"), 42, "host/boot")
    hello = Hello.from_message(Message(HELLO, "rx", "tx", 0, fields))
    assert hello == Hello(b"\x00md\xff", small_layout("bfloat16"), 42, "host/boot")


def test_pool_handle_round_trips_with_and_without_a_proof() -> None:
    for tag in (b"", proof(KEY, "inc", b"meta")):
        handle = PoolHandle(b"meta", 0x7F00DEAD0000, "VRAM", 1, tag)
        assert PoolHandle.from_bytes(handle.to_bytes()) == handle
    assert proof(KEY, "inc", b"meta") != proof(KEY, "other", b"meta")
    with pytest.raises(ValueError):
        PoolHandle.from_bytes(b"cuda-ipc-handle-bytes")


def test_block_runs_coalesce_what_both_pools_allow() -> None:
    assert block_runs((3, 4, 5, 6), (10, 11, 12, 13)) == [(3, 10, 4)]
    # A break on either side starts a new run.
    assert block_runs((3, 4, 9, 10), (0, 1, 2, 3)) == [(3, 0, 2), (9, 2, 2)]
    assert block_runs((0, 1, 2), (5, 7, 8)) == [(0, 5, 1), (1, 7, 2)]
    assert block_runs((4, 3), (1, 2)) == [(4, 1, 1), (3, 2, 1)]  # descending is no run
