"""The launcher's core plan: disjoint CPU sets, teams as wide as their share, never more
threads in all than cores; one thread each when workers outnumber cores; and how
``LocalCluster.plan`` applies it (named sets, plan off, single-process)."""

from __future__ import annotations

import os

import pytest

from gateway.core_plan import WorkerCores, plan_cores
from gateway.launcher import ClusterSpec, LocalCluster


def check_disjoint_and_within(plan: list[WorkerCores], cpus: set[int], cores: int) -> None:
    seen: set[int] = set()
    for share in plan:
        assert share.cpus <= cpus
        assert not share.cpus & seen, plan
        seen |= share.cpus
        assert 1 <= share.threads <= len(share.cpus)
    assert sum(s.threads for s in plan) <= cores


def test_one_prefill_one_decode_on_two_cores_get_one_each() -> None:
    plan = plan_cores({0, 1}, ["prefill", "decode"])
    assert plan == [WorkerCores(frozenset({0}), 1), WorkerCores(frozenset({1}), 1)]


def test_an_uneven_split_gives_the_spare_cores_to_decode_first() -> None:
    plan = plan_cores(set(range(8)), ["prefill", "decode", "decode"])
    assert [s.threads for s in plan] == [2, 3, 3]
    assert [sorted(s.cpus) for s in plan] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    check_disjoint_and_within(plan, set(range(8)), 8)
    plan = plan_cores(set(range(7)), ["prefill", "prefill", "decode"])
    assert [s.threads for s in plan] == [2, 2, 3]


@pytest.mark.parametrize("ncpu", [1, 2, 3, 4, 7, 16, 64])
@pytest.mark.parametrize(
    "kinds",
    [["both"], ["both", "both"], ["prefill", "decode"], ["prefill"] * 2 + ["decode"] * 2],
)
def test_threads_never_exceed_cores_when_every_worker_has_one(ncpu: int, kinds: list[str]) -> None:
    cpus = set(range(100, 100 + ncpu))  # not starting at 0, not the host's
    plan = plan_cores(cpus, kinds)
    assert len(plan) == len(kinds)
    if len(kinds) <= ncpu:
        check_disjoint_and_within(plan, cpus, ncpu)
        assert sum(s.threads for s in plan) == ncpu  # and every core is used
    else:
        assert all(s == WorkerCores(frozenset(cpus), 1) for s in plan)


def test_more_workers_than_cores_share_all_cpus_one_thread_each() -> None:
    plan = plan_cores({0, 1}, ["prefill", "prefill", "decode", "decode"])
    assert plan == [WorkerCores(frozenset({0, 1}), 1)] * 4


def test_with_lending_more_workers_than_cores_own_the_cores_in_turn_decode_first() -> None:
    one, two = WorkerCores(frozenset({0}), 1), WorkerCores(frozenset({1}), 1)
    kinds = ["prefill", "prefill", "decode", "decode"]
    assert plan_cores({0, 1}, kinds, co_own=True) == [one, two, one, two]
    assert plan_cores({0, 1}, ["prefill", "decode", "decode"], co_own=True) == [one, one, two]
    # A quota of 3 cores over 8 CPUs: 3 shares, one thread each, owned in turn.
    plan = plan_cores(set(range(8)), ["prefill"] * 4, cores=3, co_own=True)
    assert plan[0] == plan[3] and len(set(plan)) == 3
    check_disjoint_and_within(list(set(plan)), set(range(8)), 3)
    # As many workers as cores: co-owning changes nothing.
    assert plan_cores({0, 1}, ["prefill", "decode"], co_own=True) == [one, two]


def test_a_quota_below_the_mask_bounds_the_threads_not_the_sets() -> None:
    # 8 CPUs visible, a quota of 3 cores: disjoint sets over all 8, 3 threads in all.
    plan = plan_cores(set(range(8)), ["prefill", "decode"], cores=3)
    assert [s.threads for s in plan] == [1, 2]
    check_disjoint_and_within(plan, set(range(8)), 3)
    assert (
        plan_cores(set(range(8)), ["prefill"] * 4, cores=3)
        == [WorkerCores(frozenset(range(8)), 1)] * 4
    )


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match="cpus"):
        plan_cores(set(), ["decode"])
    with pytest.raises(ValueError, match="gateway"):
        plan_cores({0}, ["gateway"])
    with pytest.raises(ValueError, match="cores"):
        plan_cores({0}, ["decode"], cores=0)
    assert plan_cores({0}, []) == []


# --- the launcher's use of it (no process started) ------------------------------------


def mask() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0))


def test_launcher_plans_over_its_own_mask_by_default() -> None:
    cluster = LocalCluster(ClusterSpec(num_prefill=1, num_decode=2))
    try:
        plan = cluster.plan(["prefill", "decode", "decode"])
    finally:
        cluster.stop()
    assert all(s is not None for s in plan)
    if len(mask()) >= 3:
        check_disjoint_and_within(plan, set(mask()), len(mask()))  # type: ignore[arg-type]
    else:
        assert all(s.threads == 1 for s in plan)  # type: ignore[union-attr]


def test_launcher_co_owns_the_cores_only_where_workers_lend_them() -> None:
    cpu = min(mask())
    kinds = ["prefill", "decode", "decode"]
    lend = ClusterSpec(num_decode=2, cpus={k: frozenset({cpu, cpu + 1}) for k in kinds})
    keep = ClusterSpec(num_decode=2, cpus=lend.cpus, core_lending=False)
    plans = []
    for spec in (lend, keep):
        cluster = LocalCluster(spec)
        try:
            plans.append(cluster.plan(kinds))
        finally:
            cluster.stop()
    one, two = WorkerCores(frozenset({cpu}), 1), WorkerCores(frozenset({cpu + 1}), 1)
    assert plans[0] == [one, one, two]
    assert plans[1] == [WorkerCores(frozenset({cpu, cpu + 1}), 1)] * 3


def test_launcher_plan_off_leaves_workers_alone_but_keeps_named_sets() -> None:
    cpu = min(mask())
    spec = ClusterSpec(core_plan=False, cpus={"decode": frozenset({cpu})})
    cluster = LocalCluster(spec)
    try:
        assert cluster.plan(["prefill", "decode"]) == [None, WorkerCores(frozenset({cpu}), 1)]
    finally:
        cluster.stop()


def test_launcher_named_sets_are_planned_per_kind() -> None:
    spec = ClusterSpec(num_decode=2, cpus={"prefill": frozenset({0}), "decode": frozenset({2, 3})})
    cluster = LocalCluster(spec)
    try:
        plan = cluster.plan(["prefill", "decode", "decode"])
    finally:
        cluster.stop()
    assert plan == [
        WorkerCores(frozenset({0}), 1),
        WorkerCores(frozenset({2}), 1),
        WorkerCores(frozenset({3}), 1),
    ]


def test_baton_serve_plans_by_default_and_no_core_plan_turns_it_off() -> None:
    from gateway.cli import _parser, _spec

    assert _spec(_parser().parse_args(["serve"])).core_plan is True
    assert _spec(_parser().parse_args(["run", "--no-core-plan", "hi"])).core_plan is False


def test_smt_siblings_stay_with_one_worker() -> None:
    # 4 physical cores, their second threads numbered 4-7 (Linux's usual enumeration).
    siblings = [frozenset({c, c + 4}) for c in range(4)]
    plan = plan_cores(set(range(8)), ["prefill", "decode"], siblings=siblings)
    assert plan == [
        WorkerCores(frozenset({0, 1, 4, 5}), 4),
        WorkerCores(frozenset({2, 3, 6, 7}), 4),
    ]
    # Uneven: whole cores still; threads at most the CPUs of the share.
    plan = plan_cores(set(range(8)), ["prefill", "decode", "decode"], siblings=siblings)
    assert [sorted(s.cpus) for s in plan] == [[0, 4], [1, 2, 5, 6], [3, 7]]
    check_disjoint_and_within(plan, set(range(8)), 8)
    # More workers than physical cores (but not than CPUs): split single CPUs.
    plan = plan_cores(set(range(8)), ["decode"] * 5, siblings=siblings)
    check_disjoint_and_within(plan, set(range(8)), 8)
    assert len(plan) == 5


def test_topology_that_does_not_cover_the_cpus_is_ignored() -> None:
    plan = plan_cores({0, 1}, ["prefill", "decode"], siblings=[frozenset({0, 9})])
    assert plan == [WorkerCores(frozenset({0}), 1), WorkerCores(frozenset({1}), 1)]
