"""Workers dying mid-request, end to end: nothing hangs, the gateway routes around the dead
worker (a dead decode worker's streams move to another one and complete), and the
survivors free every block (DESIGN "KV ownership": every cross-process wait has a
deadline and ends with a typed status).

One cluster of the tiny model with two prefill and two decode workers, shared by the
tests; each test SIGKILLs one worker of a kind while at least two of that kind are up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protos.baton.v1 import worker_pb2
from tests.e2e_helpers import (
    E2ECluster,
    Outcome,
    assert_completed,
    collect,
    gateway_stub,
    generate,
    ids_request,
    tiny_cluster,
    wait_for,
    wait_settled,
    worker_stats,
)

# A stream on a dead worker must end within this many seconds of the kill.
FAIL_FAST_S = 5.0
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(
        tiny_llama,
        num_prefill=2,
        num_decode=2,
        # Four prompt tokens a step: a 600-token prompt is in prefill for ~0.2 s.
        prefill_args=("--max-num-batched-tokens", "4", "--num-blocks", "256"),
        decode_args=("--num-blocks", "256"),
    ) as c:
        yield c


def _live(cluster: E2ECluster, kind: str) -> list[str]:
    return [address for k, address in cluster.live_workers() if k == kind]


async def _new_requests_succeed(cluster: E2ECluster, label: str) -> None:
    async with gateway_stub(cluster.gateway_address) as stub:
        outcomes = await asyncio.gather(
            *(
                generate(stub, ids_request(30, f"{label}-{i}", max_tokens=8), timeout=30)
                for i in range(4)
            )
        )
    for outcome in outcomes:
        assert_completed(outcome, 8, cluster.logs())


def _held(stats: worker_pb2.WorkerStats) -> int:
    return stats.num_running + stats.num_waiting + stats.num_waiting_for_kv


async def test_decode_worker_killed_mid_stream(cluster: E2ECluster) -> None:
    decodes = _live(cluster, "decode")
    assert len(decodes) >= 2, "needs two live decode workers"
    async with gateway_stub(cluster.gateway_address) as stub:
        calls = [
            stub.Generate(ids_request(20, f"kill-decode-{i}", max_tokens=900), timeout=60)
            for i in range(4)
        ]
        firsts = [await call.read() for call in calls]  # every stream is decoding
        # Every request a worker holds: a stream's first token can reach the client while
        # its KV is still arriving (num_waiting_for_kv), before it counts as running.
        running = {a: _held(await worker_stats(a, "decode")) for a in decodes}
        victim = max(running, key=lambda a: running[a])
        assert running[victim] >= 1, running
        killed_at = time.monotonic()
        cluster.kill_address(victim)
        outcomes: list[Outcome] = await asyncio.gather(
            *(collect(call, began=killed_at) for call in calls)
        )
    for first, outcome in zip(firsts, outcomes, strict=True):
        outcome.responses.insert(0, first)
    # The dead worker's streams moved to the other decode worker (gateway.routing.migration):
    # every stream completes, and exactly those report a move.
    for outcome in outcomes:
        assert_completed(outcome, 900, cluster.logs())
    moves = [o.responses[-1].usage.migrations for o in outcomes]
    assert sum(moves) == running[victim], (moves, running)

    await _new_requests_succeed(cluster, "after-decode-kill")
    await wait_settled(cluster.live_workers(), logs=cluster.logs)


async def test_prefill_worker_killed_with_requests_in_flight(cluster: E2ECluster) -> None:
    prefills = _live(cluster, "prefill")
    assert len(prefills) >= 2, "needs two live prefill workers"

    async def busy_prefill() -> str | None:
        for address in prefills:
            stats = await worker_stats(address, "prefill")
            if stats.num_running >= 1 and stats.queued_prompt_tokens > 0:
                return address
        return None

    async with gateway_stub(cluster.gateway_address) as stub:
        calls = [
            stub.Generate(ids_request(600, f"kill-prefill-{i}", max_tokens=8), timeout=60)
            for i in range(4)
        ]
        victim = await wait_for(busy_prefill, "a prefill worker to be busy")
        killed_at = time.monotonic()
        cluster.kill_address(victim)
        outcomes: list[Outcome] = await asyncio.gather(
            *(collect(call, began=killed_at) for call in calls)
        )
    for outcome in outcomes:
        if outcome.code is grpc.StatusCode.OK:  # retried on the other prefill worker
            assert_completed(outcome, 8, cluster.logs())
        else:
            assert outcome.code in LOST, str(outcome)
            assert outcome.elapsed_s < FAIL_FAST_S, str(outcome)

    await _new_requests_succeed(cluster, "after-prefill-kill")
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
