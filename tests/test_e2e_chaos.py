"""Chaos through real processes under load: two prefill and two decode workers of the
tiny model behind one gateway, with traffic flowing while a worker is SIGKILLed
mid-transfer or mid-stream, SIGSTOPped past the clients' deadlines, restarted on its
port, or while hundreds of requests are cancelled at random moments.

After each: every stream that failed ended with a typed status within a stated bound,
every stream that completed produced HF's greedy tokens (a divergence counts only at a
near tie), and every surviving worker's free KV blocks are back at their initial value.
Each scenario restores the cluster (the worker restarted on its port) before it ends.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from protos.baton.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e_helpers import (
    E2ECluster,
    Outcome,
    assert_completed,
    collect,
    gateway_stub,
    generate,
    ids_request,
    prompt_ids,
    tiny_cluster,
    wait_for,
    wait_settled,
    worker_stats,
)
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model

PROMPT_LEN = 48
MAX_TOKENS = 32
LABELS = [f"chaos-{i}" for i in range(8)]
TRANSFER_TIMEOUT_S = 4.0  # decode's bound on a silent prefill peer (and prefill's on acks)
DEADLINE_S = 30.0  # the clients' deadline under normal traffic
# A stream hit by a killed worker ends within this: a lost connection is seen at once, a
# stalled peer within the transfer timeout; the rest is retries and a loaded machine.
FAILURE_BOUND_S = TRANSFER_TIMEOUT_S + 6.0
SETTLE_S = 3 * TRANSFER_TIMEOUT_S + 10.0
TYPED = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(
        tiny_llama,
        num_prefill=2,
        num_decode=2,
        worker_args=(
            "--num-blocks",
            "512",
            "--transfer-timeout-s",
            str(TRANSFER_TIMEOUT_S),
            "--grace-s",
            "2",
        ),
        decode_args=("--max-num-seqs", "32"),
        gateway_args=("--max-retries", "3", "--stats-timeout-s", "0.5"),
    ) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> dict[str, tuple[list[int], Any]]:
    hf = hf_model(tiny_llama)
    return {label: hf_greedy(hf, prompt_ids(PROMPT_LEN, label), MAX_TOKENS) for label in LABELS}


@dataclass(slots=True)
class Record:
    label: str
    outcome: Outcome
    began: float  # time.monotonic()


@dataclass(slots=True)
class Traffic:
    """``flows`` clients, each sending one request after another until stopped."""

    address: str
    flows: int = 8
    timeout: float = DEADLINE_S
    records: list[Record] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> Traffic:
        self._tasks = [asyncio.create_task(self._flow(i)) for i in range(self.flows)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _flow(self, i: int) -> None:
        rng = random.Random(i)
        async with gateway_stub(self.address) as stub:
            while not self._stop.is_set():
                label = rng.choice(LABELS)
                began = time.monotonic()
                request = ids_request(PROMPT_LEN, label, max_tokens=MAX_TOKENS)
                outcome = await generate(stub, request, self.timeout)
                self.records.append(Record(label, outcome, began))

    async def wait_served(self, n: int, after: float = 0.0, timeout: float = 60.0) -> None:
        """Until ``n`` requests that began after ``after`` completed."""

        async def enough() -> bool:
            return sum(r.began > after and r.outcome.code.name == "OK" for r in self.records) >= n

        await wait_for(enough, f"{n} requests served", timeout)


def check(records: list[Record], reference: dict, bound_s: float) -> dict[str, int]:
    """The suite's three promises for one scenario; returns the count of each status."""
    counts: dict[str, int] = {}
    for r in records:
        o = r.outcome
        counts[o.code.name] = counts.get(o.code.name, 0) + 1
        if o.code is grpc.StatusCode.OK:
            assert_completed(o, MAX_TOKENS)
            tokens = [t for resp in o.responses for t in resp.token_ids]
            assert compare_greedy(tokens, *reference[r.label]) != "mismatch", (r.label, tokens)
        else:
            assert o.code in TYPED, str(o)
            assert o.elapsed_s <= bound_s, f"took {o.elapsed_s:.1f} s > {bound_s} s: {o}"
            counts["slowest_failure_ms"] = max(
                counts.get("slowest_failure_ms", 0), round(o.elapsed_s * 1000)
            )
    return counts


def _live(cluster: E2ECluster) -> list[tuple[str, str]]:
    return cluster.live_workers()


async def _initial_free(cluster: E2ECluster) -> dict[str, int]:
    return {a: (await worker_stats(a, k)).total_kv_blocks for k, a in _live(cluster)}


async def _settled_at_initial(cluster: E2ECluster, initial: dict[str, int]) -> None:
    live = _live(cluster)
    await wait_settled(live, timeout=SETTLE_S, logs=cluster.logs)
    for kind, address in live:
        assert (await worker_stats(address, kind)).free_kv_blocks == initial[address]


def _proc(cluster: E2ECluster, address: str):  # noqa: ANN202
    (proc,) = [p for p in cluster.procs if p.address == address]
    return proc


def _restart(cluster: E2ECluster, address: str) -> None:
    """Start the (dead) worker that served ``address`` again, on the same port."""
    proc = _proc(cluster, address)
    if proc.popen.poll() is None:
        proc.popen.kill()
    proc.popen.wait()
    cluster.procs.remove(proc)
    cluster.respawn(proc.kind, cluster.argv_of(proc), int(address.rsplit(":", 1)[1]))


async def _busy(address: str, kind: str, what: str) -> None:
    """Until the worker has ``what`` in flight (polled fast: the tiny model is quick).

    A transfer: KV blocks held for a decode worker's ack, with a prompt running beside
    them. Held blocks alone are often a hand-off whose copy has landed (over shm a
    memcpy), whose request a kill no longer touches; the running prompt is one it does.
    """

    async def check_busy() -> bool:
        stats = await worker_stats(address, kind)
        if what == "transfer":
            return stats.held_kv_blocks > 0 and stats.num_running > 0
        return stats.num_running > 0

    await wait_for(check_busy, f"{kind} {address} busy with a {what}", timeout=30, interval=0.002)


async def _kill_under_load(
    cluster: E2ECluster, reference: dict, kind: str, index: int, what: str
) -> dict[str, int]:
    initial = await _initial_free(cluster)
    victim = cluster.addresses(kind)[index]
    async with Traffic(cluster.gateway_address) as traffic:
        await traffic.wait_served(8)
        await _busy(victim, kind, what)
        mark = len(_gateway_log(cluster))
        cluster.kill_address(victim)
        killed_at = time.monotonic()
        await traffic.wait_served(16, after=killed_at)  # the others carry the load
    try:
        counts = check(traffic.records, reference, FAILURE_BOUND_S)
        # The kill hit requests in flight: they failed, or the gateway retried them
        # elsewhere (before their first token), or moved their streams to another worker.
        retried = sum(
            ("failed before its first token" in line and f"{kind} {victim}" in line)
            or f"moved from {kind} {victim} " in line
            for line in _gateway_log(cluster)[mark:].splitlines()
        )
    finally:
        # Whatever the verdict, the next scenario gets the whole cluster back.
        await _settled_at_initial(cluster, {a: initial[a] for a in initial if a != victim})
        await asyncio.to_thread(_restart, cluster, victim)
        await _settled_at_initial(cluster, initial)
    assert retried or len(counts) > 1, f"the kill of {victim} hit nothing: {counts}"
    counts["retried"] = retried
    return counts


def _gateway_log(cluster: E2ECluster) -> str:
    (gateway,) = [p for p in cluster.procs if p.kind == "gateway"]
    return gateway.log.read_text(errors="replace")


def test_sigkill_of_a_prefill_worker_mid_transfer(cluster: E2ECluster, reference: dict) -> None:
    counts = asyncio.run(_kill_under_load(cluster, reference, "prefill", 0, "transfer"))
    print(f"prefill SIGKILL mid-transfer: {counts}")


def test_sigkill_of_a_decode_worker_mid_stream(cluster: E2ECluster, reference: dict) -> None:
    counts = asyncio.run(_kill_under_load(cluster, reference, "decode", 0, "stream"))
    print(f"decode SIGKILL mid-stream: {counts}")


def test_sigstop_of_a_decode_worker_past_the_clients_deadlines(
    cluster: E2ECluster, reference: dict
) -> None:
    deadline_s, stopped_s = 3.0, 6.0

    async def run() -> dict[str, int]:
        initial = await _initial_free(cluster)
        victim = cluster.addresses("decode")[1]
        pid = _proc(cluster, victim).popen.pid
        async with Traffic(cluster.gateway_address, timeout=deadline_s) as traffic:
            await traffic.wait_served(8)
            await _busy(victim, "decode", "stream")
            os.kill(pid, signal.SIGSTOP)
            try:
                stopped_at = time.monotonic()
                await asyncio.sleep(stopped_s)
                # Streams stuck on it ended by their deadlines; the rest went elsewhere.
                stuck = [
                    r
                    for r in traffic.records
                    if r.outcome.code is grpc.StatusCode.DEADLINE_EXCEEDED
                ]
                assert stuck, "the stopped worker held no stream"
                served = sum(
                    r.began > stopped_at + 1.0 and r.outcome.code.name == "OK"
                    for r in traffic.records
                )
                assert served > 0, "nothing was served while one decode worker was stopped"
            finally:
                os.kill(pid, signal.SIGCONT)
            await traffic.wait_served(8, after=time.monotonic())
        counts = check(traffic.records, reference, deadline_s + 1.5)
        await _settled_at_initial(cluster, initial)
        # It recovered: it serves a request of its own again.
        await _decode_directly(victim, cluster.addresses("prefill")[0])
        return counts

    print(
        f"decode SIGSTOP {stopped_s:.0f} s past {deadline_s:.0f} s deadlines: {asyncio.run(run())}"
    )


async def _decode_directly(decode: str, prefill: str) -> None:
    async with grpc.aio.insecure_channel(decode) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        request = worker_pb2.DecodeRequest(
            request_id="after-sigcont",
            prompt_token_ids=prompt_ids(PROMPT_LEN, LABELS[0]),
            prefill_address=prefill,
        )
        request.sampling_params.max_tokens = 4
        request.sampling_params.temperature = 0
        request.sampling_params.ignore_eos = True
        tokens = [t async for r in stub.Decode(request, timeout=30) for t in r.token_ids]
    assert len(tokens) == 4


def test_a_decode_worker_restarted_on_its_port_under_load(
    cluster: E2ECluster, reference: dict
) -> None:
    async def run() -> dict[str, int]:
        initial = await _initial_free(cluster)
        victim = cluster.addresses("decode")[0]
        before = await worker_stats(victim, "decode")
        async with Traffic(cluster.gateway_address) as traffic:
            await traffic.wait_served(8)
            await asyncio.to_thread(_restart, cluster, victim)
            after = await worker_stats(victim, "decode")
            assert after.incarnation_id != before.incarnation_id
            restarted_at = time.monotonic()

            async def new_one_serves() -> bool:
                stats = await worker_stats(victim, "decode")
                return stats.num_running > 0 or stats.prefix_cache_hit_tokens > 0

            await wait_for(new_one_serves, "the new incarnation serving", timeout=30)
            await traffic.wait_served(8, after=restarted_at)
        counts = check(traffic.records, reference, FAILURE_BOUND_S)
        await _settled_at_initial(cluster, initial)
        return counts

    print(f"decode restarted on its port: {asyncio.run(run())}")


def test_hundreds_of_requests_cancelled_at_random_moments(
    cluster: E2ECluster, reference: dict
) -> None:
    total, in_flight = 300, 32
    rng = random.Random(300)
    plan = [(rng.choice(LABELS), i % 5 != 0, rng.uniform(0.0, 0.4)) for i in range(total)]

    async def one(stub: generate_pb2_grpc.BatonStub, label: str, cancel: bool, after: float):  # noqa: ANN202
        began = time.monotonic()
        call = stub.Generate(ids_request(PROMPT_LEN, label, max_tokens=MAX_TOKENS), timeout=60)
        if not cancel:
            return Record(label, await collect(call, began), began)
        reading = asyncio.ensure_future(collect(call, began))
        await asyncio.sleep(after)
        call.cancel()
        await asyncio.wait({reading})
        if not reading.cancelled():  # a local cancel may surface as a cancelled read
            outcome = reading.result()
            assert outcome.code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED), str(outcome)
        return None

    async def run() -> dict[str, int]:
        initial = await _initial_free(cluster)
        gate = asyncio.Semaphore(in_flight)
        async with gateway_stub(cluster.gateway_address) as stub:

            async def bounded(job: tuple[str, bool, float]):  # noqa: ANN202
                async with gate:
                    return await one(stub, *job)

            began = time.monotonic()
            results = await asyncio.gather(*(bounded(job) for job in plan))
            elapsed = time.monotonic() - began
        kept = [r for r in results if r is not None]
        counts = check(kept, reference, FAILURE_BOUND_S)
        assert counts == {"OK": len(kept)}, counts  # the uncancelled ones all completed
        await _settled_at_initial(cluster, initial)
        print(f"{total} requests, {total - len(kept)} cancelled at random, in {elapsed:.1f} s")
        return counts

    asyncio.run(run())
