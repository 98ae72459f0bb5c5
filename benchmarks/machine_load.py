"""How busy the machine was while a benchmark leg ran, apart from the benchmark itself.

A ratio between two servers measured one after the other means nothing if someone else
used the cores during one of them. :class:`LoadWatch` samples, once a second, the load
average and the CPU time the whole machine spent busy (``/proc/stat``) against the CPU
time of this process tree (every descendant: servers, their engine processes, the load
generator). The difference is what *other* processes took, in cores: the figure a
harness refuses to print ratios over. The load average, which counts the benchmark's
own threads, is recorded beside it for the reader. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import process_tree

_TICKS = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent not idle since boot."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    guest = sum(ticks[8:10]) if len(ticks) > 9 else 0  # already counted in user/nice
    return (sum(ticks) - idle - guest) / _TICKS


def tree_cpu_s(root: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live process in ``root``'s tree.

    Children's reaped time (``cutime``) is left out: a child sampled while alive is
    counted from its own samples, and adding it again once reaped would count it twice.
    A child that lives and dies between two samples is missed, which can only make the
    machine look busier than it was."""
    out: dict[int, float] = {}
    for pid in process_tree(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces) start at state, field 3.
        rest = stat[stat.rindex(")") + 2 :].split()
        utime, stime = int(rest[11]), int(rest[12])
        out[pid] = (utime + stime) / _TICKS
    return out


@dataclass(slots=True)
class LoadSummary:
    """One leg's load: what others took (mean cores) and the load averages seen."""

    seconds: float
    others_cores: float  # mean cores other processes kept busy
    ours_cores: float  # mean cores this process tree kept busy
    load1_first: float
    load1_max: float
    load1_samples: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, float | list[float]]:
        return {
            "seconds": round(self.seconds, 1),
            "others_cores": round(self.others_cores, 3),
            "ours_cores": round(self.ours_cores, 3),
            "load1_first": self.load1_first,
            "load1_max": self.load1_max,
            "load1_samples": self.load1_samples,
        }


class LoadWatch:
    """``with LoadWatch() as w: ...`` then ``w.summary``. Samples on its own thread."""

    def __init__(self, interval_s: float = 1.0, root: int | None = None) -> None:
        self._interval_s = interval_s
        self._root = os.getpid() if root is None else root
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="load-watch", daemon=True)
        self._load: list[float] = []
        # pid -> (CPU seconds when first seen, CPU seconds when last seen)
        self._tree: dict[int, tuple[float, float]] = {}
        self._busy0 = self._t0 = 0.0
        self.summary: LoadSummary | None = None

    def __enter__(self) -> LoadWatch:
        self._busy0, self._t0 = machine_busy_s(), time.monotonic()
        self._observe()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._observe()
        seconds = time.monotonic() - self._t0
        busy = machine_busy_s() - self._busy0
        ours = sum(last - first for first, last in self._tree.values())
        seconds = max(seconds, 1e-9)
        self.summary = LoadSummary(
            seconds=seconds,
            others_cores=max(0.0, busy - ours) / seconds,
            ours_cores=ours / seconds,
            load1_first=self._load[0],
            load1_max=max(self._load),
            load1_samples=[round(x, 2) for x in self._load],
        )

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._observe()

    def _observe(self) -> None:
        self._load.append(os.getloadavg()[0])
        starting = not self._tree
        for pid, cpu in tree_cpu_s(self._root).items():
            if pid in self._tree:
                first = self._tree[pid][0]
            elif starting:
                first = cpu  # running before the watch: only what it spends from now on
            else:
                first = 0.0  # started during the watch: all of its time counts
            # A process that has exited keeps its last sample.
            self._tree[pid] = (first, cpu)
