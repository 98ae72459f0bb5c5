"""A cluster benchmark sent SIGTERM stops the cluster it started (benchmarks.common
.stop_on_sigterm): with SIGTERM's default action the harness died alone and left its
gateway and workers running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _group(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process in process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # it ended
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append((int(entry), cmdline.decode(errors="replace")))
    return found


def test_sigterm_to_a_cluster_benchmark_stops_its_cluster(tiny_llama: Path, tmp_path: Path) -> None:
    harness = subprocess.Popen(
        [
            sys.executable, "-m", "benchmarks.workers_on_one_host", "--model", str(tiny_llama),
            "--dtype", "float32", "--configs", "defaults", "--plans", "on", "--runs", "100000",
            "--streams", "2", "--max-tokens", "4", "--results-dir", str(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, to find what it leaves
    )  # fmt: skip
    pgid = harness.pid
    try:
        deadline = time.monotonic() + 180
        while not any("decode_service" in cmd for _, cmd in _group(pgid)):
            assert harness.poll() is None, harness.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the benchmark's cluster never started"
            time.sleep(0.2)
        harness.send_signal(signal.SIGTERM)  # the harness alone, as `kill PID` sends it
        harness.wait(timeout=60)
        deadline = time.monotonic() + 30
        while (left := _group(pgid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, left
    finally:
        for pid, _ in _group(pgid):
            os.kill(pid, signal.SIGKILL)
        if harness.poll() is None:
            harness.kill()
        harness.wait()
