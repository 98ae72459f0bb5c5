"""Admission in the scheduler: the reservation FIFO served as blocks free up, its bound,
the free-block watermark that protects admitted requests, preempted requests before new
reservations, the bound of the local queue, and fairness under sustained overload.

Driven by ``tests.fake_runner`` (torch-free): the ``Driver`` grants queued reservations
between steps exactly as the engine thread does.
"""

from __future__ import annotations

import pytest

from engine.errors import ResourceExhaustedError
from engine.request import RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from tests.fake_runner import Driver, RunningSnapshot, make_request, make_scheduler


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + k * 17 + 3) % 97 + 1 for k in range(n)]


def test_reservations_are_granted_in_arrival_order_as_blocks_free_up() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    assert sched.queue_remote(make_request("a", _prompt(0, 24))) is not None  # 6 blocks
    big = make_request("big", _prompt(1, 16))  # 4 blocks: must wait
    small = make_request("small", _prompt(2, 4))  # 1 block: would fit now, but is behind
    assert sched.queue_remote(big) is None
    assert sched.queue_remote(small) is None
    assert [r.request_id for r in sched.reserving] == ["big", "small"]
    assert big.status is RequestStatus.RESERVING and not big.block_ids
    assert sched.grant_reserved() == []  # the head does not fit; nobody overtakes it
    # reserve_remote (no queueing) must not jump the queue either.
    with pytest.raises(ResourceExhaustedError, match="2 reservation\\(s\\) wait ahead"):
        sched.reserve_remote(make_request("jumper", _prompt(3, 4)))
    sched.abort("a")
    granted = sched.grant_reserved()
    assert [r.request_id for r in granted] == ["big", "small"]
    assert all(r.status is RequestStatus.WAITING_FOR_KV for r in granted)
    assert len(big.block_ids) == 4 and len(small.block_ids) == 1 and not sched.reserving


def test_the_reservation_queue_is_bounded() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_queued=2)
    sched.queue_remote(make_request("a", _prompt(0, 15)))  # the whole pool
    sched.queue_remote(make_request("q1", _prompt(1, 4)))
    sched.queue_remote(make_request("q2", _prompt(2, 4)))
    with pytest.raises(ResourceExhaustedError, match="reservation queue is full \\(2 waiting"):
        sched.queue_remote(make_request("q3", _prompt(3, 4)))
    assert "q3" not in sched.requests and len(sched.reserving) == 2
    sched.abort("q1")  # a queued reservation that gives up leaves the queue at once
    assert [r.request_id for r in sched.reserving] == ["q2"] and "q1" not in sched.requests
    sched.queue_remote(make_request("q3", _prompt(3, 4)))
    assert sched.pool.num_free == 0


def test_the_local_queue_is_bounded() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_queued=2)
    sched.add(make_request("a", _prompt(0, 4)))
    sched.add(make_request("b", _prompt(1, 4)))
    with pytest.raises(ResourceExhaustedError, match="engine queue is full \\(2 waiting"):
        sched.add(make_request("c", _prompt(2, 4)))
    assert "c" not in sched.requests and len(sched.waiting) == 2


def test_the_watermark_keeps_blocks_for_the_growth_of_admitted_requests() -> None:
    sched = make_scheduler(num_blocks=12, block_size=4, growth_tokens=8)
    # Nothing admitted: the first may take what it needs, whatever its growth.
    sched.queue_remote(make_request("a", _prompt(0, 8), max_tokens=50))  # 2 blocks
    # 10 free; a keeps 2 blocks for its next 8 tokens; a new 4-token prompt needs 1 block
    # and keeps 2 for its own growth: 5 <= 10, granted.
    assert sched.queue_remote(make_request("b", _prompt(1, 4), max_tokens=50)) is not None
    assert sched.growth_blocks() == 4 and sched.pool.num_free == 9
    # 6 blocks + 2 growth + 4 kept = 12 > 9: it waits, though the 6 blocks are free.
    six = make_request("six", _prompt(2, 24), max_tokens=50)
    assert sched.queue_remote(six) is None
    assert sched.pool.num_free == 9
    # Growth is capped by max_tokens: a request that ends soon keeps less.
    sched.abort("six")
    short = make_request("short", _prompt(3, 19), max_tokens=1)  # 5 blocks, no growth
    assert sched.queue_remote(short) is not None and sched.pool.num_free == 4


def test_with_nothing_admitted_a_reservation_may_take_the_whole_pool() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, growth_tokens=64)
    assert len(sched.reserve_remote(make_request("all", _prompt(0, 15)))) == 4


def test_preempted_requests_go_before_new_reservations() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    d = Driver.build(sched)
    # Two local requests that each grow from 1 to 4 blocks: one is preempted.
    for rid, seed in (("old", 1), ("young", 2)):
        sched.add(make_request(rid, _prompt(seed, 3), max_tokens=12))
    while not sched.num_preemptions:
        d.run_ticks(1)
    (preempted,) = sched.waiting
    assert preempted.num_preemptions == 1
    # Blocks are free right now, but the preempted request was there first.
    assert sched.pool.num_free >= 1
    with pytest.raises(ResourceExhaustedError, match="1 preempted request\\(s\\) go first"):
        sched.reserve_remote(make_request("new", _prompt(3, 4)))
    new = make_request("new", _prompt(3, 4))
    d.reserve(new, kv_delay=1)
    assert list(sched.reserving) == [new]
    while preempted.status is not RequestStatus.RUNNING:
        assert new.status is RequestStatus.RESERVING
        d.run_ticks(1)
    d.run()
    assert new.request_id in d.granted_at and d.finish["new"] is not None


def _overload(growth_tokens: int, on_step=None) -> tuple[Scheduler, Driver, dict[str, int]]:  # noqa: ANN001
    """300 reservations, one per tick, into a pool that holds two or three requests at
    their full length: far more than can be served."""
    sched = make_scheduler(
        num_blocks=20,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_queued=1000,
        growth_tokens=growth_tokens,
    )
    d = Driver.build(sched, on_step=on_step)
    arrivals: dict[str, int] = {}
    for tick in range(300):
        rid = f"r{tick:03d}"
        arrivals[rid] = tick
        d.reserve_at(tick, make_request(rid, _prompt(tick, 9), max_tokens=MAX_TOKENS), KV_DELAY)
    d.run(max_ticks=20_000)
    return sched, d, arrivals


MAX_TOKENS, KV_DELAY = 20, 2


def test_without_a_watermark_new_arrivals_push_admitted_requests_into_recompute() -> None:
    """The control for the next test: the same load with no watermark preempts."""
    sched, _, _ = _overload(growth_tokens=0)
    assert sched.num_preemptions > 50


def test_fairness_under_sustained_overload() -> None:
    """Reservations arrive faster than they can be served, for 300 ticks. Stated bounds,
    with a watermark that covers admitted requests' growth (growth_tokens >= max_tokens):
    no admitted request is ever preempted; every admitted request gets a token in every
    step while it runs (decode first); grants follow arrival order exactly; and the k-th
    reservation waits at most k generations (max_tokens + kv_delay + 2 ticks each) of
    the requests ahead of it."""
    starved: list[str] = []

    def every_decode_scheduled(s: Scheduler, out: SchedulerOutput, before: RunningSnapshot) -> None:
        scheduled = {seq.request.request_id for seq in out.seqs}
        for rid, computed, logical, wants in before:
            if wants and logical - computed == 1 and rid not in scheduled:
                starved.append(rid)

    sched, d, arrivals = _overload(growth_tokens=MAX_TOKENS, on_step=every_decode_scheduled)
    assert sched.num_preemptions == 0
    assert not starved, f"admitted requests skipped a step: {starved[:5]}"
    by_arrival = sorted(arrivals, key=arrivals.__getitem__)
    order = sorted(d.granted_at, key=lambda rid: (d.granted_at[rid], arrivals[rid]))
    assert order == by_arrival, "grants out of arrival order"
    generation = MAX_TOKENS + KV_DELAY + 2
    for position, rid in enumerate(by_arrival):
        waited = d.granted_at[rid] - arrivals[rid]
        assert waited <= (position + 1) * generation, (rid, waited)
    assert sched.pool.num_free == sched.pool.num_blocks
    assert not (sched.requests or sched.reserving or sched.remote)


def test_preempted_requests_wait_at_most_one_generation_under_overload() -> None:
    """A pool too small for every admitted request's growth: some are preempted. With
    reservations arriving every tick, a preempted request is still re-admitted before any
    new reservation and within one generation (max_tokens + kv_delay ticks)."""
    max_tokens, kv_delay = 24, 1
    sched = make_scheduler(
        num_blocks=14,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_queued=1000,
    )
    d = Driver.build(sched)
    for tick in range(120):
        req = make_request(f"r{tick:03d}", _prompt(tick, 3), max_tokens=max_tokens)
        d.reserve_at(tick, req, kv_delay)
    preempted_at: dict[str, int] = {}
    waits: list[int] = []
    while d.events or sched.has_work() or sched.remote or sched.reserving:
        granted_before = set(d.granted_at)
        d.run_ticks(1)
        newly = set(d.granted_at) - granted_before
        for r in sched.waiting:
            preempted_at.setdefault(r.request_id, d.num_schedules)
        if newly:
            # Grants happen at the start of a tick, before that tick's step: nothing
            # preempted may have been waiting then.
            waiting_then = [rid for rid, at in preempted_at.items() if at < d.num_schedules]
            assert not waiting_then, (newly, waiting_then)
        for rid in list(preempted_at):
            if rid not in {r.request_id for r in sched.waiting}:
                waits.append(d.num_schedules - preempted_at.pop(rid))
        assert d.num_schedules < 10_000
    assert sched.num_preemptions > 0, "the scenario must preempt to test anything"
    print(f"preempted waits: max {max(waits)}, {len(waits)} preemptions")
    assert max(waits) <= max_tokens + kv_delay, waits
    assert sched.pool.num_free == sched.pool.num_blocks
