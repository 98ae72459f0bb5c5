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
"""

from __future__ import annotations

import concurrent.futures
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
        if num_threads > 0:
            torch.set_num_threads(num_threads)
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
