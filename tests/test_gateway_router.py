"""gateway.routing.router picks, on hand-set worker states (no servers: channels connect lazily)."""

from __future__ import annotations

import pytest

from engine.errors import ResourceExhaustedError, UnavailableError
from gateway.routing.router import Route, Router, WorkerKind
from protos.baton.v1 import worker_pb2
from rpc.channels import ChannelCache


def router(decode: int = 2, prefill: int = 2) -> Router:
    return Router(
        [f"d{i}:1" for i in range(decode)], [f"p{i}:1" for i in range(prefill)], ChannelCache()
    )


def set_up(r: Router, address: str, **stats: int) -> None:
    worker = next(w for w in r.workers if w.address == address)
    worker.update(worker_pb2.WorkerStats(**stats))


def test_decode_with_most_free_blocks_per_load_and_least_queued_prefill() -> None:
    r = router()
    set_up(r, "d0:1", free_kv_blocks=100, num_running=9)  # 10 per unit of load
    set_up(r, "d1:1", free_kv_blocks=40, num_running=1, num_waiting_for_kv=1)  # 13.3
    set_up(r, "p0:1", queued_prompt_tokens=900)
    set_up(r, "p1:1", queued_prompt_tokens=100)
    assert r.pick(10) == Route(decode="d1:1", prefill="p1:1")


def test_picks_between_polls_spread_the_load() -> None:
    r = router()
    for address in ("d0:1", "d1:1"):
        set_up(r, address, free_kv_blocks=50)
    set_up(r, "p0:1", queued_prompt_tokens=0)
    set_up(r, "p1:1", queued_prompt_tokens=300)
    routes = [r.pick(200) for _ in range(4)]
    assert [route.decode for route in routes] == ["d0:1", "d1:1", "d0:1", "d1:1"]
    # 0, 200, then p0 (400) is past p1 (300), ...
    assert [route.prefill for route in routes] == ["p0:1", "p0:1", "p1:1", "p0:1"]


def test_avoided_prefill_is_skipped_while_another_is_up() -> None:
    r = router()
    set_up(r, "d0:1", free_kv_blocks=1)
    set_up(r, "p0:1")
    set_up(r, "p1:1", queued_prompt_tokens=10_000)
    assert r.pick(1, avoid_prefill={"p0:1"}).prefill == "p1:1"
    assert r.pick(1, avoid_prefill={"p0:1", "p1:1"}).prefill == "p0:1"  # all avoided: best


def test_down_workers_are_not_picked_and_none_up_is_unavailable() -> None:
    r = router()
    with pytest.raises(UnavailableError, match="no decode worker is up"):
        r.pick(1)
    set_up(r, "d1:1")
    with pytest.raises(UnavailableError, match="no prefill worker is up"):
        r.pick(1)
    set_up(r, "p1:1")
    assert r.pick(1) == Route(decode="d1:1", prefill="p1:1")


def test_single_process_mode_has_no_prefill() -> None:
    r = router(decode=1, prefill=0)
    assert r.single_process
    set_up(r, "d0:1")
    assert r.pick(5) == Route(decode="d0:1", prefill="")


def test_a_full_decode_worker_is_skipped_and_all_full_is_refused_at_once() -> None:
    """Seats and queue places reported (2 + 3 each): requests held there (the report, the
    picks since, this gateway's streams) fill them, and nothing more is sent."""
    r = router(decode=2, prefill=1)
    set_up(r, "p0:1")
    set_up(
        r,
        "d0:1",
        free_kv_blocks=90,
        num_running=2,
        num_waiting=2,
        max_num_seqs=2,
        max_queued_requests=3,
    )
    set_up(r, "d1:1", free_kv_blocks=10, max_num_seqs=2, max_queued_requests=3)
    first = r.pick(1)
    assert first.decode == "d0:1"  # 4 held of 5: still room, and the most free blocks
    assert [r.pick(1).decode for _ in range(5)] == ["d1:1"] * 5  # d0 is full now
    with pytest.raises(ResourceExhaustedError, match="every decode worker is at capacity"):
        r.pick(1)
    with pytest.raises(ResourceExhaustedError, match="every decode worker is at capacity"):
        r.check_room(0)


def test_streams_that_ended_since_the_last_report_free_their_places() -> None:
    r = router(decode=1, prefill=0)
    set_up(r, "d0:1", max_num_seqs=1, max_queued_requests=1)
    routes = [r.pick(1), r.pick(1)]
    with r.using(routes[0]), r.using(routes[1]):
        with pytest.raises(ResourceExhaustedError):
            r.pick(1)
    assert r.pick(1).decode == "d0:1"  # both ended: their places count as free again


def test_requests_admitted_but_not_yet_routed_count_against_the_capacity() -> None:
    """A burst is refused on arrival: this gateway's requests still being tokenized hold
    places too."""
    r = router(decode=2, prefill=0)
    for address in ("d0:1", "d1:1"):
        set_up(r, address, max_num_seqs=64, max_queued_requests=256)
    r.check_room(639)
    with pytest.raises(ResourceExhaustedError, match="640 requests held against 640"):
        r.check_room(640)


def test_workers_that_report_no_bounds_are_never_full() -> None:
    r = router(decode=1, prefill=0)
    set_up(r, "d0:1", num_running=10_000)  # an older worker: no max_num_seqs in Stats
    r.check_room(10_000)
    assert r.pick(1).decode == "d0:1"


def test_bad_worker_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="decode must list"):
        Router([], [], ChannelCache())
    with pytest.raises(ValueError, match="prefill lists a target twice"):
        Router(["d:1"], ["p:1", "p:1"], ChannelCache())
    with pytest.raises(ValueError, match="target .nowhere. must be HOST:PORT"):
        Router(["nowhere"], [], ChannelCache())


async def test_probe_of_an_unknown_worker_is_an_error() -> None:
    r = router()
    with pytest.raises(ValueError, match="prefill worker 'd0:1' is not known"):
        await r.probe("d0:1", WorkerKind.PREFILL)
