"""The CPU budget of this process: how many cores its compute team may use, and which.

A process may run on the CPUs of its affinity mask (``sched_getaffinity``: a launcher's
pinning, a container's cpuset), for as much time as its cgroup's CPU quota grants
(cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; Kubernetes sets
it from the container's CPU limit). ``os.cpu_count()`` is neither: it counts the host's
cores, and torch's default OpenMP team counts them too. A team sized that way on a pod
with a 2-core limit, or in one of several workers pinned to a share of one host, spins
more threads than it has cores, and every parallel region then waits on a thread that is
not running (``benchmarks/workers_on_one_host.py``: 5-12x slower on 2 cores).

:func:`read_cpu_budget` reads both and :attr:`CpuBudget.cores` is the team size that
fits. Torch-free; the files it reads are injectable so tests use fakes.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """What this process may use; ``cores`` is the thread count that fits it."""

    cpus: frozenset[int]  # the affinity mask: where its threads may run
    quota_cores: float | None = None  # the cgroup CPU quota in cores; None: no quota
    limit_cores: float | None = None  # a limit the deployment states (k8s limits.cpu)

    @property
    def cores(self) -> int:
        """Threads that fit: the smallest of the CPUs, the quota and the limit, at least 1.

        A fractional quota or limit rounds down (1.5 -> 1): a team of 2 on 1.5 cores of
        quota is throttled for part of every period, and each parallel region's barrier
        then waits for the throttled thread, which costs more than the half core gains.
        """
        bound = len(self.cpus) or 1
        for share in (self.quota_cores, self.limit_cores):
            if share is not None:
                bound = min(bound, math.floor(share + 1e-9))
        return max(1, bound)


def read_cpu_budget(
    *,
    limit_cores: float | None = None,
    affinity: frozenset[int] | None = None,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    cgroup_root: Path = CGROUP_ROOT,
) -> CpuBudget:
    """The calling process's budget: its affinity mask (``affinity`` overrides, for tests)
    and its cgroup quota, with an optional stated ``limit_cores`` (> 0) on top."""
    if limit_cores is not None and not limit_cores > 0:
        raise ValueError(f"limit_cores must be > 0, got {limit_cores}")
    cpus = frozenset(os.sched_getaffinity(0)) if affinity is None else frozenset(affinity)
    return CpuBudget(cpus, cgroup_quota_cores(proc_cgroup, cgroup_root), limit_cores)


def cgroup_quota_cores(
    proc_cgroup: Path = PROC_SELF_CGROUP, cgroup_root: Path = CGROUP_ROOT
) -> float | None:
    """The CPU quota, in cores, of the cgroup ``proc_cgroup`` names and its ancestors
    (the tightest one counts), v2 or v1; None when there is none or it cannot be read
    (no cgroup filesystem, a host without the controller): then only the mask bounds."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":  # v2: one unified hierarchy, "0::/path"
            quotas += _v2_quotas(cgroup_root, path)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            quotas += _v1_quotas(cgroup_root, controllers, path)
    return min(quotas) if quotas else None


def _candidate_dirs(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and its ancestors up to ``mount``; only those that exist. In a
    container the mount is usually the container's own cgroup while ``path`` names it
    from the host's root, so ``mount`` itself is always a candidate."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2_quotas(root: Path, path: str) -> list[float]:
    out = []
    for d in _candidate_dirs(root, path):
        try:
            quota, _, period = (d / "cpu.max").read_text().strip().partition(" ")
        except OSError:
            continue
        if quota == "max":
            continue
        try:
            out.append(int(quota) / int(period or "100000"))
        except (ValueError, ZeroDivisionError):
            logger.warning("ignoring an unreadable %s", d / "cpu.max")
    return out


def _v1_quotas(root: Path, controllers: str, path: str) -> list[float]:
    # The hierarchy is mounted under its controller list ("cpu,cpuacct"), often with
    # symlinks by each name ("cpu"): try them all.
    mounts = [root / controllers, *(root / c for c in controllers.split(",") if c == "cpu")]
    out = []
    for mount in dict.fromkeys(mounts):
        for d in _candidate_dirs(mount, path):
            try:
                quota = int((d / "cpu.cfs_quota_us").read_text())
                period = int((d / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if quota > 0 and period > 0:  # -1: no quota
                out.append(quota / period)
    return out


def physical_cores(
    cpus: frozenset[int], sys_cpu: Path = Path("/sys/devices/system/cpu")
) -> list[frozenset[int]]:
    """``cpus`` grouped by physical core (SMT siblings together, from each CPU's
    ``topology/thread_siblings_list``), ordered by their lowest CPU; a CPU whose topology
    cannot be read is a core of its own."""
    groups: dict[frozenset[int], None] = {}
    for cpu in sorted(cpus):
        try:
            text = (sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            siblings = parse_cpu_list(text) & cpus
        except (OSError, ValueError):
            siblings = frozenset()
        groups.setdefault(siblings or frozenset({cpu}), None)
    return sorted(groups, key=min)


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8} (the kernel's cpu-list format); ValueError if bad."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(f"cpu list {text!r} is not like '0-3,8'") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"cpu list {text!r} has a bad range {part!r}")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError(f"cpu list {text!r} names no CPU")
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 3, 8} -> ``"0-3,8"``."""
    ordered = sorted(cpus)
    ranges: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)


def pin_process(cpus: frozenset[int]) -> None:
    """Restrict every thread of this process to ``cpus``, and threads it starts later
    (they inherit the mask of the thread that starts them). Call it before torch builds
    its OpenMP team. ValueError if ``cpus`` holds none this process may use."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    except OSError as err:
        raise ValueError(f"cannot pin to CPUs {format_cpu_list(cpus)}: {err}") from err
