"""How the launcher shares one host's cores between the workers it starts.

Every worker runs one OpenMP compute team (``engine.compute_thread``). Teams that
together hold more threads than there are cores spin against each other: a parallel
region ends at a barrier, and a barrier waits for the thread that is not running. On 2
cores, 3 to 5 workers with a team as wide as the machine each served 5-12x slower than
one (issue 16). So the plan gives each worker a disjoint set of CPUs and a team as wide
as its share, and never more threads in all than the cores the launcher may use.

SMT siblings (two CPUs of one physical core) stay in one worker's set when there are at
least as many physical cores as workers: a worker whose threads ran on the other halves
of its neighbour's cores would contend with it for every execution unit.

With more workers than cores no split can keep the teams apart. Where the workers lend
each other idle cores (``engine.core_lending``), the cores are split as for one worker
each and the workers take turns on them, decode first, each with a team of one thread:
co-owners of a share that are busy together move to an idle share if there is one.
Otherwise every worker gets a team of one thread on all the CPUs, and the kernel's
scheduler balances the workers, rather than pinning two busy ones on one core while
another core idles.

Pure: the caller reads the budget (``engine.cpu_budget``) and starts the processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerCores:
    """One worker's share: where it may run and how wide its compute team is."""

    cpus: frozenset[int]
    threads: int


# The order the cores left after an even split go out in: decode (and single-process)
# workers step for every token of every stream, prefill workers once per prompt chunk.
_SPARE_CORE_ORDER = ("decode", "both", "prefill")


def plan_cores(
    cpus: frozenset[int] | set[int],
    kinds: Sequence[str],
    cores: int | None = None,
    siblings: Sequence[frozenset[int]] | None = None,
    co_own: bool = False,
) -> list[WorkerCores]:
    """One :class:`WorkerCores` per entry of ``kinds`` (prefill | decode | both), in order.

    ``cpus``: the CPUs to share (the launcher's affinity mask); ``cores``: how many of
    them its CPU quota lets it use at once (default all); ``siblings``: ``cpus`` grouped
    by physical core (``engine.cpu_budget.physical_cores``; default one CPU each). Each
    worker gets a disjoint slice of whole physical cores (of single CPUs when workers
    outnumber physical cores) and ``threads`` = its share of ``cores``, at most its CPUs,
    so the threads sum to at most ``cores``; with more workers than cores, every worker
    gets all of ``cpus`` and one thread, or (``co_own``) one of ``cores`` shares, which
    the workers own in turn (decode first, then in worker order).
    """
    ordered = sorted(cpus)
    if not ordered:
        raise ValueError("cpus must name at least one CPU")
    unknown = [k for k in kinds if k not in _SPARE_CORE_ORDER]
    if unknown:
        raise ValueError(f"kinds must be among {_SPARE_CORE_ORDER}, got {unknown}")
    cores = len(ordered) if cores is None else cores
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    cores = min(cores, len(ordered))
    n = len(kinds)
    if n == 0:
        return []
    if n > cores and co_own:
        shares = plan_cores(frozenset(ordered), ["both"] * cores, cores, siblings)
        order = sorted(range(n), key=lambda i: (_SPARE_CORE_ORDER.index(kinds[i]), i))
        turn = {i: t for t, i in enumerate(order)}
        return [shares[turn[i] % cores] for i in range(n)]
    if n > cores:
        return [WorkerCores(frozenset(ordered), 1) for _ in kinds]
    units = [frozenset(g) & frozenset(ordered) for g in (siblings or ())]
    units = [u for u in units if u]
    if sorted(c for u in units for c in u) != ordered or n > len(units):
        units = [frozenset({c}) for c in ordered]  # no (usable) topology: one CPU each
    units.sort(key=min)
    plan, start = [], 0
    for threads, width in zip(_split(cores, kinds), _split(len(units), kinds), strict=True):
        share = frozenset().union(*units[start : start + width])
        plan.append(WorkerCores(share, min(threads, len(share))))
        start += width
    return plan


def _split(total: int, kinds: Sequence[str]) -> list[int]:
    """``total`` split evenly over ``kinds``; the remainder, one each, to the kinds first
    in :data:`_SPARE_CORE_ORDER` (then in worker order)."""
    base, spare = divmod(total, len(kinds))
    shares = [base] * len(kinds)
    by_priority = sorted(range(len(kinds)), key=lambda i: (_SPARE_CORE_ORDER.index(kinds[i]), i))
    for i in by_priority[:spare]:
        shares[i] += 1
    return shares
