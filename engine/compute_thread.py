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

Any other thread that runs torch ops must run them serially, or its first op large
enough to parallelize (a step's input tensors for a big batch, a KV copy) creates that
second team for good: after a W1 run that built its steps' inputs on the driving
thread, batch-1 decode in the same process ran at 53 tok/s instead of 77. So the
synchronous step runs whole on the compute thread, and the threads that run torch ops
beside it (the asynchronous engine's, the transfer threads) call
``serial_torch_thread`` first. (Switching a thread's count back and forth per step is no
way out: each switch also rebuilds torch's process-wide pthreadpool.)
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class ComputeThread:
    def __init__(self, num_threads: int = 0, name: str = "runner"):
        """``num_threads`` > 0 sets torch's intra-op threads on the compute thread."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._ident = self._pool.submit(self._start, num_threads).result()

    @staticmethod
    def _start(num_threads: int) -> int:
        # Always explicit: a thread's count is otherwise copied, at its first op, from
        # the last count any thread set (``serial_torch_thread`` sets 1 elsewhere).
        torch.set_num_threads(num_threads if num_threads > 0 else _default_threads())
        return threading.get_ident()

    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident

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


def _default_threads() -> int:
    """What torch's default would be: ``OMP_NUM_THREADS`` when set, else a thread per CPU
    this process may run on."""
    try:
        wanted = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        wanted = 0
    return wanted if wanted > 0 else (len(os.sched_getaffinity(0)) or 1)


def serial_torch_thread() -> None:
    """Run every later torch op of the calling thread on that thread alone. For threads
    of their own (transfers) that share the cores with a compute thread."""
    torch.set_num_threads(1)
