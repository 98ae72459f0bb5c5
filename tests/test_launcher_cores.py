"""A launched cluster's workers run where the core plan put them: every thread of each
worker within its CPU set (the worker pinned itself at start, no preexec_fn), and its
compute team as wide as its share; a decode worker beside an idle prefill worker
computes on both shares (engine.core_lending) and is back on its own once idle."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import pytest

from engine.cpu_budget import parse_cpu_list
from gateway.launcher import ClusterSpec, LocalCluster
from tests.e2e_helpers import assert_completed, gateway_stub, generate, ids_request
from tests.test_e2e_scaling import scrape


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
        metrics=True,
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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for each worker")
def test_a_decode_worker_borrows_the_idle_prefill_workers_core(tiny_llama: Path) -> None:
    spec = ClusterSpec(
        model=str(tiny_llama),
        dtype="float32",
        start_timeout_s=180.0,
        log_level="INFO",
        metrics=True,
    )
    with LocalCluster(spec) as cluster:
        assert cluster.core_shares is not None
        prefill, decode = (next(p for p in cluster.procs if p.kind == k) for k in WORKERS)
        assert prefill.cores and decode.cores and not prefill.cores.cpus & decode.cores.cpus

        async def one() -> None:
            async with gateway_stub(cluster.gateway_address) as stub:
                outcome = await generate(stub, ids_request(24, "lend", max_tokens=32))
            assert_completed(outcome, 32, cluster.logs())

        asyncio.run(one())
        # The prefill worker is idle while decode runs the stream's 31 steps (metrics are
        # a snapshot a moment old: wait for the steps to show).
        for _ in range(100):
            seen = scrape(decode)
            if seen.get("baton_engine_steps_total", 0.0) >= 31:  # absent before a snapshot
                break
            time.sleep(0.05)
        assert seen["baton_cpu_borrowed_forwards_total"] >= 16, seen
        # Idle again: every thread back on its own share within the loop's idle tick.
        both = prefill.cores.cpus | decode.cores.cpus
        for _ in range(40):
            if thread_masks(decode.popen.pid) == {decode.cores.cpus}:
                break
            time.sleep(0.05)
        assert thread_masks(decode.popen.pid) == {decode.cores.cpus}, both
        assert thread_masks(prefill.popen.pid) == {prefill.cores.cpus}


WORKERS = ("prefill", "decode")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to share")
def test_more_workers_than_cores_own_them_in_turn_and_borrow_idle_ones(tiny_llama: Path) -> None:
    """2 prefill + 2 decode workers on two CPUs: each pinned to one CPU it owns with a
    worker of the other role; a stream's decode worker, its neighbours idle, computes on
    both CPUs, and every worker is back on its own once idle."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    spec = ClusterSpec(
        model=str(tiny_llama),
        dtype="float32",
        num_prefill=2,
        num_decode=2,
        cpus={k: frozenset({a, b}) for k in WORKERS},
        start_timeout_s=180.0,
        log_level="INFO",
        metrics=True,
    )
    with LocalCluster(spec) as cluster:
        assert cluster.core_shares is not None
        workers = [p for p in cluster.procs if p.kind != "gateway"]
        for cpu in (a, b):
            owners = sorted(p.kind for p in workers if p.cores and p.cores.cpus == {cpu})
            assert owners == ["decode", "prefill"], [(p.kind, p.cores) for p in workers]

        async def one() -> None:
            async with gateway_stub(cluster.gateway_address) as stub:
                outcome = await generate(stub, ids_request(24, "co-own", max_tokens=32))
            assert_completed(outcome, 32, cluster.logs())

        asyncio.run(one())
        decoders = [p for p in workers if p.kind == "decode"]
        for _ in range(100):
            seen = [scrape(p) for p in decoders]
            if max(s["baton_engine_steps_total"] for s in seen) >= 31:
                break
            time.sleep(0.05)
        stepped = max(seen, key=lambda s: s["baton_engine_steps_total"])
        assert stepped["baton_cpu_borrowed_forwards_total"] >= 16, seen
        for proc in workers:
            assert proc.cores is not None
            for _ in range(40):
                if thread_masks(proc.popen.pid) == {proc.cores.cpus}:
                    break
                time.sleep(0.05)
            assert thread_masks(proc.popen.pid) == {proc.cores.cpus}, proc.kind

        # The decode workers lend each other cores (one core group), so a burst is packed
        # onto one of them, which computes on both CPUs, rather than spread over two
        # that would each read the weights for half the rows. Prompts of 40 tokens go to
        # a prefill worker (past the default local-prefill bound).
        before = [scrape(p).get("baton_generation_tokens_total", 0.0) for p in decoders]

        async def burst() -> None:
            async with gateway_stub(cluster.gateway_address) as stub:
                requests = [ids_request(40, f"burst-{i}", max_tokens=12) for i in range(4)]
                outcomes = await asyncio.gather(*(generate(stub, r) for r in requests))
            for outcome in outcomes:
                assert_completed(outcome, 12, cluster.logs())

        asyncio.run(burst())
        for _ in range(100):
            after = [scrape(p).get("baton_generation_tokens_total", 0.0) for p in decoders]
            added = sorted(a - b for a, b in zip(after, before, strict=True))
            if sum(added) >= 4 * 11:
                break
            time.sleep(0.05)
        assert added[0] == 0 and added[1] >= 4 * 11, (before, after)


def test_add_workers_refuses_bad_kinds_and_one_command_line_for_several(tmp_path: Path) -> None:
    """Checked before anything starts: nothing is spawned."""
    cluster = LocalCluster(ClusterSpec(model="unused"), workdir=tmp_path)
    with pytest.raises(ValueError, match="kind must be one of .* got 'gateway'"):
        cluster.add_workers(["decode", "gateway"])
    with pytest.raises(ValueError, match="argv and port name one worker"):
        cluster.add_workers(["decode", "prefill"], port=5000)
    single = LocalCluster(ClusterSpec(model="unused", mode="single"), workdir=tmp_path)
    with pytest.raises(ValueError, match=r"in single mode, got 'prefill'"):
        single.add_workers(["prefill"])
    assert cluster.procs == single.procs == []
