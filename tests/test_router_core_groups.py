"""Decode workers of one core group (on one host, lending each other idle cores) are
packed: a burst fills one member while it has a seat, blocks and no queue, where workers
without a group, or in different groups, are spread (gateway.routing.router._packed).
Hand-set worker states, no servers; the group itself comes from engine.core_lending."""

from __future__ import annotations

from pathlib import Path

from engine.core_lending import CoreLending, core_group, create_share
from engine.kv_events import prefix_block_hashes
from engine.kv_layout import KVLayout
from engine.stats import EngineStats
from gateway.routing.kv_feed import KVFeed
from gateway.routing.kv_index import KVIndex
from gateway.routing.router import Router
from gateway.routing.workers import WorkerKind, WorkerState
from protos.baton.v1 import kv_pb2, worker_pb2
from rpc import convert
from rpc.channels import ChannelCache

HOST_A, HOST_B = "boot-a:/run/shares", "boot-b:/run/shares"


def router(decode: int) -> Router:
    return Router([f"d{i}:1" for i in range(decode)], ["p0:1"], ChannelCache())


def set_up(r: Router, address: str, group: str = "", **stats: int) -> WorkerState:
    fields = {"free_kv_blocks": 100, "max_num_seqs": 4, "max_queued_requests": 8} | stats
    worker = next(w for w in r.workers if w.address == address)
    worker.update(
        worker_pb2.WorkerStats(core_group=group, kv_layout=kv_pb2.KVLayout(block_size=16), **fields)
    )
    return worker


def decodes(r: Router, n: int, prompt_tokens: int = 32) -> list[str]:
    return [r.pick(prompt_tokens).decode for _ in range(n)]


def test_a_burst_fills_one_member_of_a_group_then_the_next() -> None:
    r = router(2)
    set_up(r, "d0:1", HOST_A)
    set_up(r, "d1:1", HOST_A)
    set_up(r, "p0:1")
    # Four seats each: the fifth request goes to the other member, which then fills.
    assert decodes(r, 6) == ["d0:1"] * 4 + ["d1:1"] * 2


def test_without_a_group_the_same_workers_are_spread() -> None:
    r = router(2)
    set_up(r, "d0:1")
    set_up(r, "d1:1")
    set_up(r, "p0:1")
    assert decodes(r, 4) == ["d0:1", "d1:1", "d0:1", "d1:1"]


def test_the_busiest_member_with_room_is_filled_first() -> None:
    r = router(3)
    set_up(r, "d0:1", HOST_A)
    set_up(r, "d1:1", HOST_A, num_running=2)
    set_up(r, "d2:1", HOST_A, num_running=1)
    set_up(r, "p0:1")
    assert decodes(r, 3) == ["d1:1", "d1:1", "d2:1"]


def test_a_member_with_a_queue_or_short_of_blocks_passes_the_request_on() -> None:
    r = router(2)
    set_up(r, "d0:1", HOST_A, num_running=3, num_waiting=1)
    set_up(r, "d1:1", HOST_A)
    set_up(r, "p0:1")
    assert decodes(r, 1) == ["d1:1"]
    r = router(2)
    set_up(r, "d0:1", HOST_A, num_running=1, free_kv_blocks=3)
    set_up(r, "d1:1", HOST_A)
    set_up(r, "p0:1")
    assert decodes(r, 1, prompt_tokens=49) == ["d1:1"]  # 4 blocks of 16 needed, 3 free
    r = router(2)
    set_up(r, "d0:1", HOST_A, num_running=1, free_kv_blocks=3)
    set_up(r, "d1:1", HOST_A)
    set_up(r, "p0:1")
    assert decodes(r, 1, prompt_tokens=48) == ["d0:1"]  # exactly 3 blocks: it fits


def test_groups_on_different_hosts_are_spread_and_each_is_packed() -> None:
    r = router(4)
    for i, group in enumerate((HOST_A, HOST_A, HOST_B, HOST_B)):
        set_up(r, f"d{i}:1", group)
    set_up(r, "p0:1")
    # One host, then the other (its members' load together), each on its first member.
    assert decodes(r, 6) == ["d0:1", "d2:1", "d0:1", "d2:1", "d0:1", "d2:1"]


def test_a_lone_worker_beside_a_group_gets_its_share() -> None:
    r = router(3)
    set_up(r, "d0:1", HOST_A)
    set_up(r, "d1:1", HOST_A)
    set_up(r, "d2:1")  # another host, lending nothing
    set_up(r, "p0:1")
    # The group's 200 free blocks per its load against the lone worker's 100 (a tie
    # goes to the first listed): two of three go to the group, packed.
    assert decodes(r, 3) == ["d0:1", "d0:1", "d2:1"]


def test_with_every_member_full_the_request_goes_by_load() -> None:
    r = router(2)
    set_up(r, "d0:1", HOST_A, num_running=4, num_waiting=2)
    set_up(r, "d1:1", HOST_A, num_running=4, num_waiting=1)
    set_up(r, "p0:1")
    assert decodes(r, 1) == ["d1:1"]  # more free blocks per unit of load


def test_workers_borrowing_from_one_directory_report_one_group(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for directory in (tmp_path, other):
        create_share(directory, frozenset({0}), 1)
        create_share(directory, frozenset({1}), 1)
    a = CoreLending(tmp_path, frozenset({0}), 1)
    b = CoreLending(tmp_path, frozenset({1}), 1)
    c = CoreLending(other, frozenset({0}), 1)
    deterministic = CoreLending(other, frozenset({1}), 1, borrow=False)
    try:
        assert a.group == b.group == core_group(tmp_path) != ""
        assert c.group == core_group(other) != a.group
        assert deterministic.group == ""  # it never borrows: packing would gain nothing
    finally:
        for lending in (a, b, c, deterministic):
            lending.close()


def test_the_group_travels_in_stats_to_the_router() -> None:
    stats = EngineStats(
        num_running=0, num_waiting=0, num_waiting_for_kv=0, num_total_blocks=8,
        num_free_blocks=8, num_held_blocks=0, num_queued_prompt_tokens=0,
        prefix_hit_tokens=0, prefix_query_tokens=0, num_preemptions=0, num_steps=0,
        busy_seconds=0.0, core_group=HOST_A,
    )  # fmt: skip
    layout = KVLayout(2, 16, 2, 8, "float32")
    state = WorkerState("d0:1", WorkerKind.DECODE)
    state.update(convert.worker_stats_to_proto("decode", "inc", stats, 0.0, layout))
    assert state.core_group == HOST_A
    assert state.block_size == 16


def kv_router(local_prefill_tokens: int) -> tuple[Router, KVIndex]:
    """Cache-aware routing (the default), conditional disaggregation at the given bound."""
    index, channels = KVIndex(), ChannelCache()
    r = Router(
        ["d0:1", "d1:1"],
        ["p0:1"],
        channels,
        kv_feed=KVFeed(index, channels),
        local_prefill_tokens=local_prefill_tokens,
    )
    for address in ("d0:1", "d1:1"):
        set_up(r, address, HOST_A)
    set_up(r, "p0:1")
    return r, index


def prompt(label: int) -> list[int]:
    return [1000 * label + t for t in range(32)]  # two blocks; no two labels share one


def test_short_prompts_prefilled_on_decode_workers_are_packed_too() -> None:
    r, _ = kv_router(local_prefill_tokens=64)
    routes = [r.pick(32, prompt=prompt(i)) for i in range(4)]
    assert [route.prefill for route in routes] == [""] * 4  # local prefills
    # Packed while the first member's local prompt tokens (two of 32) fit in the bound
    # that keeps its streams' inter-token latency; then the next member.
    assert [route.decode for route in routes] == ["d0:1", "d0:1", "d1:1", "d1:1"]


def test_remote_prefills_with_nothing_cached_are_packed() -> None:
    r, _ = kv_router(local_prefill_tokens=0)
    routes = [r.pick(32, prompt=prompt(i)) for i in range(4)]
    assert {route.prefill for route in routes} == {"p0:1"}
    assert [route.decode for route in routes] == ["d0:1"] * 4


def test_a_member_holding_the_prompts_prefix_keeps_it_over_packing() -> None:
    r, index = kv_router(local_prefill_tokens=0)
    held = prompt(7)
    index.apply(
        "d1:1",
        seq=1,
        snapshot=True,
        stored=prefix_block_hashes(held, 16),
        removed=(),
        block_size=16,
    )
    set_up(r, "d0:1", HOST_A, num_running=2)  # the busier one, which packing would fill
    assert r.pick(32, prompt=held).decode == "d1:1"
    assert r.pick(32, prompt=prompt(8)).decode == "d0:1"  # nothing held: packed


def test_a_burst_of_long_prompts_moves_on_once_their_blocks_fill_a_member() -> None:
    """Between two reports, the blocks of the prompts already picked count against a
    member's free blocks: a burst of long prompts fills one member's pool, not its queue."""
    r = router(2)
    set_up(r, "d0:1", HOST_A, free_kv_blocks=20)
    set_up(r, "d1:1", HOST_A, free_kv_blocks=20)
    set_up(r, "p0:1")
    # 160 tokens: 10 blocks of 16 each; two fit in a member's 20 free blocks.
    assert decodes(r, 4, prompt_tokens=160) == ["d0:1", "d0:1", "d1:1", "d1:1"]
