"""The seq_cst atomics the shm and cuda_ipc lease tables rest on (``shared_atomics``):
what they do, that they are atomic across processes, that the tables use nothing else,
and that a CPU without them is refused."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
import time

import numpy as np
import pytest

from engine.transfer import shared_atomics, shm
from engine.transfer.cuda_ipc import CudaIpcReceiver
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.shared_atomics import AtomicOps, AtomicWords, atomic_ops
from tests.transfer_peer import REPO, SMALL_GROUPS, random_pool, small_layout


def _deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


def _sources() -> list[str]:
    names = ["x86-64 built-in"] if atomic_ops().source == "x86-64 built-in" else []
    if ctypes.util.find_library("atomic") is not None:
        names.append("libatomic")
    return names


@pytest.mark.parametrize("source", _sources())
def test_atomic_words_swap_load_and_store(source: str) -> None:
    make = dict(shared_atomics._sources())[source]
    ops: AtomicOps = make()
    table = np.zeros(4, dtype=np.int64)
    words = AtomicWords(table, ops)
    words.store(1, -5)
    assert words.load(1) == -5 and table[1] == -5
    assert words.cas(1, 0, 9) == -5 and table[1] == -5  # expected 0: no swap
    assert words.cas(1, -5, 9) == -5 and table[1] == 9
    big = (1 << 63) - 1
    assert words.cas(2, 0, big) == 0 and words.load(2) == big
    with pytest.raises(IndexError):
        words.load(4)
    with pytest.raises(IndexError):
        words.cas(-1, 0, 1)


@pytest.mark.parametrize("source", _sources())
def test_bulk_forms_act_on_the_listed_words_in_order(source: str) -> None:
    ops: AtomicOps = dict(shared_atomics._sources())[source]()
    table = np.zeros(8, dtype=np.int64)
    words = AtomicWords(table, ops)
    index = words.index((5, 1, 6, 2))
    words.store_all(index, 3)
    assert table.tolist() == [0, 3, 3, 0, 0, 3, 3, 0]
    assert words.all_equal(index, 3) and not words.all_equal(words.index((0, 1)), 3)
    table[6] = 4  # the third word no longer holds what a swap expects
    assert words.cas_prefix(index, 3, 7) == 2 and table.tolist() == [0, 7, 3, 0, 0, 7, 4, 0]
    assert words.cas_prefix(index, 3, 8, start=3) == 1 and table[2] == 8
    assert words.cas_prefix(index, 7, 0, start=0, end=1) == 1 and table[5] == 0 and table[1] == 7
    assert words.all_equal(words.index(()), 1)  # nothing to check: vacuously true
    with pytest.raises(IndexError):
        words.index((3, 8))
    with pytest.raises(IndexError):
        AtomicWords(np.zeros(4, dtype=np.int64), ops).all_equal(index, 0)  # checked for 8
    with pytest.raises(IndexError):
        words.cas_prefix(index, 0, 1, start=3, end=5)


_CONTENDER = """
import mmap, sys, time
import numpy as np
from engine.transfer.shared_atomics import AtomicWords
with open(sys.argv[1], "r+b") as f:
    words = AtomicWords(np.frombuffer(mmap.mmap(f.fileno(), 24), dtype=np.int64))
words.cas(2, words.load(2), words.load(2) + 1)  # ready (a lost update only delays the test)
while words.load(1) == 0:  # both start together, so their swaps really race
    time.sleep(0.001)
for _ in range(int(sys.argv[2])):
    while True:
        old = words.load(0)
        if words.cas(0, old, old + 1) == old:
            break
"""


def test_compare_and_swap_is_atomic_across_processes(tmp_path: object) -> None:
    """Two processes add to one shared word by compare-and-swap, at once: no increment
    is lost."""
    import mmap

    path = f"{tmp_path}/words"
    with open(path, "wb") as f:
        f.write(bytes(24))  # counter, go, ready
    with open(path, "r+b") as f:
        words = AtomicWords(np.frombuffer(mmap.mmap(f.fileno(), 24), dtype=np.int64))
    n = 50000
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONTENDER, path, str(n)], env=env)
        for _ in range(2)
    ]
    try:
        end = time.monotonic() + 60
        while words.load(2) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        words.store(1, 1)
        for proc in procs:
            assert proc.wait(120) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    assert words.load(0) == 2 * n


def test_lease_tables_are_only_reached_through_the_atomics() -> None:
    layout = small_layout()
    receiver = make_receiver("shm", layout, 8, config=SMALL_GROUPS)
    try:
        segment = receiver._segment  # type: ignore[attr-defined]
        assert isinstance(segment.owner, AtomicWords) and isinstance(segment.claim, AtomicWords)
        lease = receiver.expect("r", (2, 5), 1, _deadline())
        assert segment.owner.load(2) == segment.owner.load(5) == lease.lease_token
        # No lock round trip stands in for a barrier any more.
        assert not hasattr(shm, "full_barrier")
    finally:
        receiver.close()


def test_shm_refuses_a_cpu_without_atomics(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without the built-in atomics and without libatomic, shm (and cuda_ipc by
    the same code) refuses to start, saying why, instead of racing on plain stores."""
    monkeypatch.setattr(shared_atomics.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(shared_atomics.ctypes.util, "find_library", lambda name: None)
    atomic_ops.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="shm transport cannot run here.*aarch64.*libatomic"):
            make_receiver("shm", small_layout(), 8)
        pool = random_pool(small_layout(), 8, seed=1)
        with pytest.raises(RuntimeError, match="shm transport cannot run here"):
            make_sender("shm", pool, small_layout())
        with pytest.raises(RuntimeError, match="cuda_ipc transport cannot run here"):
            CudaIpcReceiver(small_layout(), 8)  # refused before it looks for a GPU
    finally:
        monkeypatch.undo()
        atomic_ops.cache_clear()
    assert atomic_ops().source  # the real ones are back for the tests that follow
