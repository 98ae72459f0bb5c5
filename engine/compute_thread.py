"""The one thread that runs every torch computation of an engine.

torch's CPU kernels parallelize with OpenMP, and GNU OpenMP gives every thread that
starts a parallel region its own team of worker threads. Once a process manages more
such threads than it has CPUs, libgomp stops spinning between parallel regions
("throttled" waiting) and puts its workers to sleep, so every region then pays a futex
wake-up: with the model loaded on the main thread and the forward run on another, a
decode step of W1 took 20-35% longer than the same step on the main thread
(``benchmarks/results/w1_profile_*``). So an engine loads its model, allocates its KV
pool and runs every forward on this one thread, whichever loop drives it: the
synchronous ``EngineCore.step`` and the asynchronous engine see the same OpenMP team,
and no other thread of the process needs one.

``call`` runs a function there and waits (directly when already on it); ``submit``
returns a future. The thread sets its own intra-op thread count, since OpenMP's is
per thread.

A thread of ours that still runs small torch ops beside it (the asynchronous engine's
scheduling thread building a step's inputs, the KV transfer workers copying blocks)
calls ``serial_torch_here`` first: one parallel region on such a thread would give it a
team for the life of the process and throttle the compute thread's for good (a 64-seq
W1 decode mask did: single-stream decode then took 35-50 ms a token instead of 20).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import re
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from engine.cpu_budget import read_cpu_budget

T = TypeVar("T")

# The OpenMP runtime torch loaded: GNU (libgomp, its own copy in a pip wheel), LLVM or Intel.
_OPENMP_LIBRARY = re.compile(r"/lib[gi]?omp[^/]*\.so[^/]*$")


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already mapped into this process, or None (no OpenMP build)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if _OPENMP_LIBRARY.search(line.rstrip())}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            # Already loaded: dlopen hands back the same library, with its state.
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.omp_set_num_threads  # noqa: B018 - raises AttributeError if absent
            return lib
        except (OSError, AttributeError):
            continue
    return None


def serial_torch_here() -> bool:
    """Run every later torch op of the calling thread on that thread alone; True if done.

    Sets OpenMP's thread count for this thread only (it is a per-thread setting), after
    torch's lazy per-thread initialization so that torch does not set it back; unlike
    ``torch.set_num_threads`` it leaves the process-wide default alone. Never call it on
    the compute thread.
    """
    torch.get_num_threads()  # torch's one-time init of this thread's OpenMP setting
    runtime = _openmp_runtime()
    if runtime is None:
        return False
    runtime.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


class ComputeThread:
    def __init__(self, num_threads: int = 0, name: str = "runner"):
        """``num_threads`` > 0 sets torch's intra-op threads on the compute thread; 0
        sizes them from the process's CPU budget (``engine.cpu_budget``: affinity mask
        and cgroup quota), never from the host's core count as torch's default does."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._ident = self._pool.submit(self._start, num_threads).result()

    @staticmethod
    def _start(num_threads: int) -> int:
        torch.set_num_threads(num_threads if num_threads > 0 else read_cpu_budget().cores)
        return threading.get_ident()

    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident

    def num_threads(self) -> int:
        """torch's intra-op threads on the compute thread: the forward's OpenMP team."""
        return self.call(torch.get_num_threads)

    def holds_every_core(self) -> bool:
        """Whether the forward's team is as large as the CPUs this process may run on:
        then any other thread's work during a forward takes a core from it."""
        return self.num_threads() >= len(os.sched_getaffinity(0))

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` behind what is already queued; never blocks."""
        return self._pool.submit(fn, *args)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the compute thread; blocks until done, re-raises its error."""
        if self.on_thread():
            return fn(*args)
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        """Finish what is queued and end the thread. Idempotent."""
        self._pool.shutdown(wait=True)
