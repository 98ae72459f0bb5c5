"""A worker settles its CPUs at start: pinned to ``--cpus``, and ``--num-threads 0``
resolved from its budget (mask, cgroup quota, ``--cpu-limit``). Run in a child process,
since pinning is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SETTLE = """
import json, os, sys, threading
from rpc.worker_config import WorkerConfig
from rpc.worker_cpus import settle_cpus
# A thread started before pinning is moved too (gRPC's or an import's would be).
early = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
early.start()
cfg = settle_cpus(WorkerConfig.from_args("decode", sys.argv[1:], {}))
tasks = os.listdir("/proc/self/task")
masks = [sorted(os.sched_getaffinity(int(t))) for t in tasks]
print(json.dumps({"threads": cfg.engine.num_threads, "masks": masks,
                  "torch": "torch" in sys.modules}))
"""


def settle(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SETTLE, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_pins_every_thread_and_sizes_the_team_from_the_pinned_cpus() -> None:
    cpu = min(os.sched_getaffinity(0))
    got = settle("--cpus", str(cpu))
    assert got["masks"] and all(m == [cpu] for m in got["masks"]), got
    assert got["threads"] == 1
    assert not got["torch"]  # settled before torch (and its OpenMP runtime) loads


def test_a_stated_limit_bounds_the_team_and_an_explicit_count_wins() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    assert settle("--cpu-limit", "1")["threads"] == 1
    assert settle("--cpu-limit", "1", "--num-threads", "3")["threads"] == 3
    unbounded = settle()["threads"]
    assert 1 <= unbounded <= len(cpus)


def test_cpus_outside_the_mask_fail_the_start() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "decode_service", "--cpus", "4095", "--port", "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "cannot pin to CPUs 4095" in proc.stderr
