"""A launched cluster's workers run where the core plan put them: every thread of each
worker within its CPU set (the worker pinned itself at start, no preexec_fn), and its
compute team as wide as its share."""

from __future__ import annotations

import os
import re
from pathlib import Path

from engine.cpu_budget import parse_cpu_list
from gateway.launcher import ClusterSpec, LocalCluster


def thread_masks(pid: int) -> set[frozenset[int]]:
    masks = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended
            continue
        listed = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
        assert listed, status
        masks.add(parse_cpu_list(listed.group(1)))
    return masks


def test_workers_pin_themselves_to_their_share_and_size_their_teams(tiny_llama: Path) -> None:
    spec = ClusterSpec(
        model=str(tiny_llama),
        dtype="float32",
        num_prefill=1,
        num_decode=1,
        start_timeout_s=180.0,
        log_level="INFO",
    )
    with LocalCluster(spec) as cluster:
        workers = [p for p in cluster.procs if p.kind != "gateway"]
        assert len(workers) == 2
        shares = [p.cores for p in workers]
        assert all(s is not None for s in shares)
        cores = len(os.sched_getaffinity(0))
        assert sum(s.threads for s in shares) <= max(cores, len(shares))  # type: ignore[union-attr]
        for proc in workers:
            share = proc.cores
            assert share is not None
            # Every thread, those gRPC and torch started after the pin included.
            assert thread_masks(proc.popen.pid) == {share.cpus}, proc.kind
            log = proc.log.read_text(errors="replace")
            assert f"-> {share.threads} compute threads" in log, log[-2000:]
        if cores >= 2:  # disjoint when every worker has a core of its own
            assert not workers[0].cores.cpus & workers[1].cores.cpus  # type: ignore[union-attr]
        gateway = cluster.process("gateway")
        assert thread_masks(gateway.pid) == {frozenset(os.sched_getaffinity(0))}
