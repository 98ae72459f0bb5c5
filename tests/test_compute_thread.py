"""Torch parallelism stays on the engine's compute thread (engine.compute_thread).

A second thread that runs a parallel torch op gets an OpenMP team of its own (new OS
threads), after which libgomp, managing more threads than CPUs, throttles every barrier
of the compute thread's team: batch-1 decode fell from 77 to 53 tok/s after a W1 run whose
input preparation ran such ops on the driving thread. The observable is the process's
thread count: a new team adds threads that stay.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.compute_thread import ComputeThread, serial_torch_thread
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core

BIG = 1 << 22  # far beyond torch's grain size: parallel whenever the thread may


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _growth_on_a_fresh_thread(work: Callable[[], None]) -> int:
    """How many OS threads ``work``, run on a thread new to torch, leaves behind."""
    before = _threads()
    t = threading.Thread(target=work)
    t.start()
    t.join()
    return _threads() - before


needs_two_cpus = pytest.mark.skipif(
    torch.get_num_threads() < 2, reason="one CPU: torch never starts an OpenMP team"
)


@needs_two_cpus
def test_a_parallel_op_on_another_thread_leaves_a_team_behind() -> None:
    """The hazard itself, so that the tests below can fail."""

    def parallel() -> None:
        torch.set_num_threads(2)
        torch.ones(BIG).sum()

    assert _growth_on_a_fresh_thread(parallel) > 0


@needs_two_cpus
def test_serial_torch_thread_starts_no_team() -> None:
    def serial() -> None:
        serial_torch_thread()
        torch.ones(BIG).sum()

    _growth_on_a_fresh_thread(serial)  # the first count change builds torch's pthreadpool
    assert _growth_on_a_fresh_thread(serial) == 0


def test_compute_thread_sets_its_count_whatever_another_thread_set() -> None:
    def one() -> None:
        serial_torch_thread()  # leaves torch's process-wide default at 1

    t = threading.Thread(target=one)
    t.start()
    t.join()
    compute = ComputeThread(num_threads=0)
    try:
        expected = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
        assert compute.call(torch.get_num_threads) == expected
    finally:
        compute.shutdown()


def test_a_synchronous_step_runs_no_torch_op_on_the_callers_thread(tiny_llama: Path) -> None:
    """``EngineCore.step`` builds the step's inputs (``prepare``: decode masks and tables,
    of 48 x 768 and up here) on the compute thread, as it runs the forward there."""
    core = make_core(
        tiny_llama, num_threads=2, num_blocks=4096, max_num_seqs=48, max_num_batched_tokens=8192
    )
    runner = core.runner
    where: set[int] = set()
    prepare = runner.prepare

    def recording_prepare(sched):  # type: ignore[no-untyped-def]
        where.add(threading.get_ident())
        return prepare(sched)

    runner.prepare = recording_prepare  # type: ignore[method-assign]
    try:
        prompts = [[(7 * i + j) % 500 + 3 for j in range(700)] for i in range(48)]
        core.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        compute = runner.compute.call(threading.get_ident)
        assert where == {compute}, "a step's inputs were built off the compute thread"
    finally:
        runner.close()
