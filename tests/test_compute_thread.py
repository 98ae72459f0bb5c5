"""Only the compute thread gets an OpenMP team: ``serial_torch_here`` and the threads of
ours that run torch ops beside it.

GNU OpenMP gives each thread that starts a parallel region a team of workers for the
life of that thread, and once a process holds more of them than it has CPUs, every team
sleeps between regions (a team shows as new tasks of the process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.compute_thread import serial_torch_here
from engine.sampling_params import SamplingParams
from engine.transfer.base import SendJob
from engine.transfer.factory import make_receiver, make_sender
from tests.engine_helpers import make_core
from tests.transfer_peer import SMALL_GROUPS, random_pool, small_layout, wait_for

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """At least two intra-op threads, so that a parallel op would start a team."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Counted in a fresh process: in the suite's own, other tests' threads come and go.
_COUNT_TEAM_TASKS = """
import os, threading, torch
from engine.compute_thread import serial_torch_here
torch.set_num_threads(2)
def added(serial):
    out = []
    def main():
        if serial:
            assert serial_torch_here()
        before = set(os.listdir("/proc/self/task"))
        (torch.ones(1 << 22) * 2 + 1).sum()
        out.append(len(set(os.listdir("/proc/self/task")) - before))
    t = threading.Thread(target=main)
    t.start()
    t.join()
    return out[0]
print(added(False), added(True))
"""


def test_a_parallel_op_on_a_new_thread_starts_a_team_unless_confined() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_TEAM_TASKS], capture_output=True, text=True,
        timeout=120, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    unconfined, confined = map(int, out.stdout.split())
    assert unconfined >= 1, "a parallel op on a new thread starts that thread's team"
    assert confined == 0


def test_confining_a_thread_leaves_other_threads_and_the_default_alone(
    two_torch_threads: None,
) -> None:
    threads = torch.get_num_threads()
    seen: list[int] = []

    def confined() -> None:
        serial_torch_here()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=confined)
    t.start()
    t.join()
    assert seen == [1]
    assert torch.get_num_threads() == threads
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [threads], "a thread started later still gets the process default"


def test_a_synchronous_step_runs_its_torch_ops_on_the_compute_thread(tiny_llama: Path) -> None:
    """Building its inputs included: a 64-seq W1 decode mask built on the caller's thread
    gave that thread a team."""
    core = make_core(tiny_llama, num_blocks=128)
    runner = core.runner
    seen: set[str] = set()
    prepare, run = runner.prepare, runner._run

    def recording_prepare(sched):  # type: ignore[no-untyped-def]
        seen.add(f"prepare on the compute thread: {runner.compute.on_thread()}")
        return prepare(sched)

    def recording_run(step):  # type: ignore[no-untyped-def]
        seen.add(f"run on the compute thread: {runner.compute.on_thread()}")
        return run(step)

    runner.prepare = recording_prepare  # type: ignore[method-assign]
    runner._run = recording_run  # type: ignore[method-assign]
    try:
        core.generate([[5, 6, 7, 8], [9, 10]], GREEDY)
        core.add_request(core.make_request("x", [11, 12, 13], GREEDY))
        runner.forward_logits(core.scheduler.schedule())
    finally:
        runner.close()
    assert seen == {"prepare on the compute thread: True", "run on the compute thread: True"}


async def _where_steps_are_prepared(
    tiny_llama: Path, overlap: bool
) -> tuple[set[tuple[bool, int]], int]:
    """(on the compute thread?, torch threads) of every step's input preparation in an
    AsyncEngine run of one request, and the tokens it produced."""
    core = make_core(tiny_llama, num_blocks=128)
    engine = AsyncEngine(core, overlap=overlap)
    seen: set[tuple[bool, int]] = set()
    prepare = core.runner.prepare

    def recording_prepare(sched):  # type: ignore[no-untyped-def]
        seen.add((core.runner.compute.on_thread(), torch.get_num_threads()))
        return prepare(sched)

    core.runner.prepare = recording_prepare  # type: ignore[method-assign]
    await engine.start()
    try:
        tokens = [t async for out in engine.generate("r", [5, 6, 7, 8], GREEDY)
                  for t in out.new_token_ids]  # fmt: skip
    finally:
        await engine.shutdown()
        core.runner.close()
    return seen, len(tokens)


async def test_the_async_engine_thread_builds_steps_without_a_team(
    tiny_llama: Path, two_torch_threads: None
) -> None:
    seen, _ = await _where_steps_are_prepared(tiny_llama, overlap=True)
    assert seen == {(False, 1)}, "steps are prepared on the engine thread, serially"


def test_the_async_engine_overlaps_only_where_the_forward_leaves_a_core_free(
    tiny_llama: Path, two_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = make_core(tiny_llama, num_blocks=128)
    try:
        assert core.runner.compute.num_threads() == 2
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
        assert AsyncEngine(core).overlap is False  # the team holds both cores
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
        assert AsyncEngine(core).overlap is True
        assert AsyncEngine(core, overlap=False).overlap is False
    finally:
        core.runner.close()


async def test_the_serial_async_engine_runs_its_steps_on_the_compute_thread(
    tiny_llama: Path, two_torch_threads: None
) -> None:
    seen, tokens = await _where_steps_are_prepared(tiny_llama, overlap=False)
    assert seen == {(True, 2)}, "the whole loop runs on the compute thread, with its team"
    assert tokens == GREEDY.max_tokens


def test_kv_transfer_workers_copy_and_verify_serially(
    monkeypatch: pytest.MonkeyPatch, two_torch_threads: None
) -> None:
    import engine.transfer.lease_receiver as lease_receiver

    layout = small_layout()
    seen: dict[str, int] = {}
    checksum = lease_receiver.checksum_blocks

    def recording_checksum(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["receiver"] = torch.get_num_threads()
        return checksum(*args, **kwargs)

    monkeypatch.setattr(lease_receiver, "checksum_blocks", recording_checksum)
    receiver = make_receiver("shm", layout, 32, config=SMALL_GROUPS)
    sender = make_sender("shm", random_pool(layout, 16, seed=3), layout, SMALL_GROUPS)
    sender._on_group = lambda rid, group: seen.setdefault("sender", torch.get_num_threads())  # type: ignore[attr-defined]
    try:
        end = time.monotonic() + 20
        desc = receiver.expect("r", (5, 6), 1, end)
        sender.submit(SendJob("r", (1, 2), desc, end))
        sent = wait_for(sender.poll, 20)
        assert sent.ok, sent.error
        receiver.verify("r", sent.checksum, sent.epoch)
        assert wait_for(receiver.poll, 20).ok
    finally:
        sender.close()
        receiver.close()
    assert seen == {"sender": 1, "receiver": 1}
