"""The CPU budget: affinity mask intersected with the cgroup CPU quota (v1 and v2, read
from fake files), and the cpu-list format the launcher passes to workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.cpu_budget import (
    CpuBudget,
    cgroup_quota_cores,
    format_cpu_list,
    parse_cpu_list,
    read_cpu_budget,
)

EIGHT = frozenset(range(8))


def v2_host(tmp_path: Path, cpu_max: dict[str, str], own: str = "/kubepods/pod1/c1") -> Path:
    """A v2 hierarchy under tmp_path/cg with ``cpu.max`` files at the given paths, and a
    /proc/self/cgroup naming ``own``; returns the latter."""
    root = tmp_path / "cg"
    (root / own.strip("/")).mkdir(parents=True, exist_ok=True)
    for path, text in cpu_max.items():
        d = root / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(text + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{own}\n")
    return proc


def test_v2_quota_bounds_the_affinity_mask(tmp_path: Path) -> None:
    proc = v2_host(tmp_path, {"/kubepods/pod1/c1": "200000 100000"})
    budget = read_cpu_budget(affinity=EIGHT, proc_cgroup=proc, cgroup_root=tmp_path / "cg")
    assert budget.cpus == EIGHT
    assert budget.quota_cores == pytest.approx(2.0)
    assert budget.cores == 2


def test_v2_max_means_no_quota_and_the_mask_decides(tmp_path: Path) -> None:
    proc = v2_host(tmp_path, {"/kubepods/pod1/c1": "max 100000", "/": "max 100000"})
    budget = read_cpu_budget(
        affinity=frozenset({2, 3, 5}), proc_cgroup=proc, cgroup_root=tmp_path / "cg"
    )
    assert budget.quota_cores is None
    assert budget.cores == 3


def test_v2_tightest_ancestor_counts(tmp_path: Path) -> None:
    proc = v2_host(tmp_path, {"/kubepods/pod1/c1": "max 100000", "/kubepods/pod1": "300000 100000"})
    assert cgroup_quota_cores(proc, tmp_path / "cg") == pytest.approx(3.0)


def test_v2_inside_a_container_namespace_reads_the_mount_itself(tmp_path: Path) -> None:
    # /proc/self/cgroup names a host path that is not under the container's mount.
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cpu.max").write_text("150000 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/burstable/pod9/abc\n")
    assert cgroup_quota_cores(proc, root) == pytest.approx(1.5)
    # A fractional quota rounds down: a team of 2 on 1.5 cores would be throttled.
    assert read_cpu_budget(affinity=EIGHT, proc_cgroup=proc, cgroup_root=root).cores == 1


def test_v1_cfs_quota_over_period(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    d = root / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("400000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    budget = read_cpu_budget(affinity=EIGHT, proc_cgroup=proc, cgroup_root=root)
    assert budget.quota_cores == pytest.approx(4.0)
    assert budget.cores == 4


def test_v1_minus_one_is_no_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    d = root / "cpu"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("1:cpu:/\n")
    assert cgroup_quota_cores(proc, root) is None
    assert read_cpu_budget(affinity=EIGHT, proc_cgroup=proc, cgroup_root=root).cores == 8


def test_an_unreadable_cgroup_leaves_the_mask(tmp_path: Path) -> None:
    assert cgroup_quota_cores(tmp_path / "missing", tmp_path) is None
    proc = tmp_path / "cgroup"
    proc.write_text("0::/nowhere\n")
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "cpu.max").write_text("garbage\n")
    assert cgroup_quota_cores(proc, tmp_path / "cg") is None
    budget = read_cpu_budget(
        affinity=frozenset({0, 1}), proc_cgroup=tmp_path / "missing", cgroup_root=tmp_path
    )
    assert budget.cores == 2


def test_a_stated_limit_bounds_too_and_a_tiny_quota_still_gives_one(tmp_path: Path) -> None:
    assert CpuBudget(EIGHT, quota_cores=None, limit_cores=3).cores == 3
    assert CpuBudget(EIGHT, quota_cores=6.0, limit_cores=3).cores == 3
    assert CpuBudget(EIGHT, quota_cores=0.25).cores == 1
    assert CpuBudget(frozenset({4}), quota_cores=16.0, limit_cores=16).cores == 1
    with pytest.raises(ValueError, match="limit_cores"):
        read_cpu_budget(limit_cores=0, proc_cgroup=tmp_path / "missing")


def test_the_real_process_budget_is_within_its_affinity() -> None:
    budget = read_cpu_budget()
    assert budget.cpus == frozenset(os.sched_getaffinity(0))
    assert 1 <= budget.cores <= len(budget.cpus)


def test_cpu_lists_round_trip_and_bad_ones_name_the_value() -> None:
    assert parse_cpu_list("0-3,8") == frozenset({0, 1, 2, 3, 8})
    assert parse_cpu_list(" 5 ") == frozenset({5})
    assert format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert format_cpu_list({7}) == "7"
    for bad in ("", "a-b", "3-1", "-2"):
        with pytest.raises(ValueError, match="cpu list"):
            parse_cpu_list(bad)


def test_physical_cores_group_smt_siblings_from_sysfs(tmp_path: Path) -> None:
    from engine.cpu_budget import physical_cores

    for cpu in range(4):
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(f"{cpu % 2},{cpu % 2 + 2}\n")
    assert physical_cores(frozenset(range(4)), tmp_path) == [
        frozenset({0, 2}),
        frozenset({1, 3}),
    ]
    # Only the CPUs asked about; a CPU without topology is a core of its own.
    assert physical_cores(frozenset({0, 1, 7}), tmp_path) == [
        frozenset({0}),
        frozenset({1}),
        frozenset({7}),
    ]
