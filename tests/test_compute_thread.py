"""Only the compute thread gets an OpenMP team: ``serial_torch_here`` and the threads of
ours that run torch ops beside it.

GNU OpenMP gives each thread that starts a parallel region a team of workers for the
life of that thread, and once a process holds more of them than it has CPUs, every team
sleeps between regions. A team shows as new tasks of this process, which is what these
tests count.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
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
LONGER = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """At least two intra-op threads, so that a parallel op would start a team."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tasks_added_on_a_new_thread(work: Callable[[], object], serial: bool) -> int:
    """Tasks the process gained while ``work`` ran on a fresh thread (still alive)."""
    added: list[int] = []
    failure: list[BaseException] = []

    def main() -> None:
        try:
            if serial:
                assert serial_torch_here(), "no OpenMP runtime found to confine"
            before = _tasks()
            work()
            added.append(_tasks() - before)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failure.append(exc)

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return added[0]


def _big_elementwise() -> torch.Tensor:
    x = torch.ones(1 << 22)
    return (x * 2 + 1).sum()


def test_a_parallel_op_on_a_new_thread_starts_a_team_unless_confined(
    two_torch_threads: None,
) -> None:
    assert _tasks_added_on_a_new_thread(_big_elementwise, serial=False) >= 1
    assert _tasks_added_on_a_new_thread(_big_elementwise, serial=True) == 0


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


def test_a_synchronous_step_runs_no_torch_on_the_calling_thread(
    tiny_llama: Path, two_torch_threads: None
) -> None:
    """A decode batch whose attention mask is past torch's parallel grain (40 rows of
    ~900 columns; enough new tokens that all 40 decode together after the 9 prefill
    steps): built on the caller's thread it started a team there."""
    core = make_core(
        tiny_llama, num_blocks=4096, max_num_seqs=48, max_num_batched_tokens=4096,
        max_model_len=1024,
    )  # fmt: skip
    prompts = [[100 + i % 50] * 880 for i in range(40)]
    try:
        assert _tasks_added_on_a_new_thread(lambda: core.generate(prompts, LONGER), False) == 0
    finally:
        core.runner.close()


async def test_the_async_engine_thread_builds_steps_without_a_team(
    tiny_llama: Path, two_torch_threads: None
) -> None:
    core = make_core(tiny_llama, num_blocks=128)
    engine = AsyncEngine(core)
    seen: set[tuple[bool, int]] = set()
    prepare = core.runner.prepare

    def recording_prepare(sched):  # type: ignore[no-untyped-def]
        seen.add((core.runner.compute.on_thread(), torch.get_num_threads()))
        return prepare(sched)

    core.runner.prepare = recording_prepare  # type: ignore[method-assign]
    await engine.start()
    try:
        async for _ in engine.generate("r", [5, 6, 7, 8], GREEDY):
            pass
    finally:
        await engine.shutdown()
        core.runner.close()
    assert seen == {(False, 1)}, "steps are prepared on the engine thread, serially"


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
