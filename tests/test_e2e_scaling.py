"""Scaling a running deployment, through real processes: workers come and go under steady
traffic and no request fails.

The gateway finds workers by ``dns:///`` names that the launcher answers from its resolve
file (``gateway.launcher``), as a headless Service lists its ready pods:

- workers started after the gateway are listed once they serve, and take requests;
- SIGTERM on a prefill worker that holds KV no decode worker has acknowledged yet (every
  decode worker is SIGSTOPped meanwhile, so none can): it reports NOT_SERVING and takes
  no new work, but stays until the acks arrive, then exits 0;
- SIGTERM on a decode worker with streams in flight: they run to completion, new work
  goes elsewhere (a request it refuses with UNAVAILABLE before its first token is
  retried), and it exits 0; new workers of both kinds started meanwhile take over;
- SIGTERM on the gateway: a new call is refused, the stream in flight finishes, it exits 0.

Every request completes with the tokens HF greedy gives (up to a near tie), and at the
end every live worker has every KV block free. One cluster for the module (2-core CI).
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gateway.launcher import LocalProcess
from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e_helpers import (
    E2ECluster,
    Outcome,
    assert_completed,
    collect,
    gateway_stub,
    generate,
    prompt_ids,
    tiny_cluster,
    wait_settled,
    worker_stats,
)
from tests.engine_helpers import compare_greedy, hf_greedy_many, hf_model

MAX_TOKENS = 24
# The stream in flight while the gateway drains: long enough (a second or more of the
# tiny model's steps) to outlast the refusal of a new call.
LONG_TOKENS = 800
PROMPTS = [prompt_ids(16 + 8 * i, f"scaling-{i}") for i in range(6)]
CLIENTS = 4  # requests in flight at any moment
EXIT_S = 60.0  # a draining worker's longest way out here (grace 30 s, plus start-up slack)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[tuple[list[int], object]]:
    model = hf_model(tiny_llama)
    return hf_greedy_many(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    # Routed by load: the traffic repeats six prompts, which cache-aware routing would
    # rightly keep on the workers that already hold them, and a new worker would get none.
    with tiny_cluster(
        tiny_llama,
        num_prefill=2,
        num_decode=2,
        metrics=True,
        gateway_args=("--routing", "load"),
    ) as c:
        yield c


def request(n: int, max_tokens: int = MAX_TOKENS) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=PROMPTS[n]),
        sampling_params=common_pb2.SamplingParameters(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
    )


class Traffic:
    """``CLIENTS`` callers sending the prompts round-robin, back to back, until stopped."""

    def __init__(self, stub: generate_pb2_grpc.BatonStub) -> None:
        self.outcomes: list[tuple[int, Outcome]] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._client(c, stub)) for c in range(CLIENTS)]

    async def _client(self, c: int, stub: generate_pb2_grpc.BatonStub) -> None:
        i = c
        while not self._stop.is_set():
            n = i % len(PROMPTS)
            i += CLIENTS
            self.outcomes.append((n, await generate(stub, request(n), timeout=60)))

    async def until(self, count: int, timeout_s: float = 60.0) -> None:
        """Wait until ``count`` more requests have ended."""
        target = len(self.outcomes) + count
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < target:
            assert time.monotonic() < deadline, f"only {len(self.outcomes)} requests ended"
            await asyncio.sleep(0.05)

    async def stop(self) -> list[tuple[int, Outcome]]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes


def assert_all_correct(
    outcomes: list[tuple[int, Outcome]],
    reference: list[tuple[list[int], object]],
    logs: str,
    max_tokens: int = MAX_TOKENS,
) -> None:
    for n, outcome in outcomes:
        assert_completed(outcome, max_tokens, logs)
        ours = [t for r in outcome.responses for t in r.token_ids]
        ref, ref_logits = reference[n]
        assert compare_greedy(ours, ref, ref_logits) in ("equal", "tie"), (
            f"prompt {n}: {ours} vs HF {ref}"
        )


def scrape(proc: LocalProcess) -> dict[str, float]:
    """The process's metrics, by sample name (label sets summed)."""
    text = urllib.request.urlopen(f"http://{proc.metrics_address}/metrics", timeout=5).read()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def wait_kv_moved(procs: list[LocalProcess], timeout_s: float = 30.0) -> None:
    """Until every one of ``procs`` has moved KV: it took requests."""
    deadline = time.monotonic() + timeout_s
    while True:
        moved = {p.address: scrape(p).get("baton_kv_transfer_bytes_total", 0.0) for p in procs}
        if all(moved.values()):
            return
        assert time.monotonic() < deadline, f"workers that took no request: {moved}"
        await asyncio.sleep(0.2)


def workers(cluster: E2ECluster, kind: str) -> list[LocalProcess]:
    return [p for p in cluster.procs if p.kind == kind and p.popen.poll() is None]


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2
        )
    return reply.status


async def exit_code(proc: LocalProcess) -> int:
    return await asyncio.to_thread(proc.popen.wait, EXIT_S)


def drained_calls(proc: LocalProcess) -> int:
    """How many calls the worker had in flight when its drain began (from its log)."""
    found = re.findall(r"draining: (\d+) call\(s\) in flight", proc.log.read_text())
    assert found, f"{proc.kind} {proc.address} never started draining:\n{proc.log.read_text()}"
    return int(found[-1])


def assert_clean_exit(proc: LocalProcess, code: int) -> None:
    log = proc.log.read_text(errors="replace")
    assert code == 0, f"{proc.kind} {proc.address} exited {code}:\n{log[-3000:]}"
    assert "still in flight after" not in log, f"the drain ran out of time:\n{log[-3000:]}"


async def test_workers_started_after_the_gateway_take_requests(
    cluster: E2ECluster, reference: list
) -> None:
    async with gateway_stub(cluster.gateway_address) as stub:
        traffic = Traffic(stub)
        try:
            await traffic.until(4)
            added = await asyncio.to_thread(cluster.add_workers, ["decode", "prefill"])
            await wait_kv_moved(added)
        finally:
            outcomes = await traffic.stop()
    assert_all_correct(outcomes, reference, cluster.logs())
    assert len(workers(cluster, "decode")) == len(workers(cluster, "prefill")) == 3


async def test_sigterm_drains_a_prefill_and_a_decode_worker_under_steady_traffic(
    cluster: E2ECluster, reference: list
) -> None:
    prefill = workers(cluster, "prefill")[0]
    decodes = workers(cluster, "decode")
    decode = decodes[0]

    def freeze(sig: signal.Signals) -> None:
        for proc in decodes:
            proc.popen.send_signal(sig)

    async with gateway_stub(cluster.gateway_address) as stub:
        traffic = Traffic(stub)
        try:
            await traffic.until(8)

            # Prefill: catch it holding KV that no decode worker can acknowledge (all are
            # stopped, so none can order more either); briefly, so none is taken for dead.
            for _ in range(60):
                freeze(signal.SIGSTOP)
                await asyncio.sleep(0.1)
                if (await worker_stats(prefill.address, "prefill")).held_kv_blocks:
                    break
                freeze(signal.SIGCONT)
                await asyncio.sleep(0.3)
            else:
                pytest.fail("the prefill worker never held unacknowledged KV")
            try:
                cluster.terminate(prefill)
                await asyncio.sleep(1.0)
                assert await health(prefill.address) == health_pb2.HealthCheckResponse.NOT_SERVING
                assert prefill.popen.poll() is None, "it left before decode acknowledged its KV"
            finally:
                freeze(signal.SIGCONT)
            assert_clean_exit(prefill, await exit_code(prefill))
            assert drained_calls(prefill) >= 1

            # Decode: SIGTERM with streams in flight (two, so that one ending just then
            # still leaves one); they finish.
            deadline = time.monotonic() + 30
            while True:
                stats = await worker_stats(decode.address, "decode")
                if stats.num_running + stats.num_waiting_for_kv >= 2:
                    break
                assert time.monotonic() < deadline, "the decode worker never ran two streams"
                await asyncio.sleep(0.01)
            cluster.terminate(decode)
            added = await asyncio.to_thread(cluster.add_workers, ["prefill", "decode"])
            assert_clean_exit(decode, await exit_code(decode))
            assert drained_calls(decode) >= 1
            await wait_kv_moved(added)
            await traffic.until(8)
        finally:
            freeze(signal.SIGCONT)
            outcomes = await traffic.stop()
    assert_all_correct(outcomes, reference, cluster.logs())
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
    for proc in workers(cluster, "decode"):
        assert scrape(proc)["baton_kv_quarantined_leases"] == 0


async def test_sigterm_on_the_gateway_finishes_its_stream_and_exits(
    cluster: E2ECluster, reference: list
) -> None:
    (gateway,) = [p for p in cluster.procs if p.kind == "gateway"]
    async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
        stub = generate_pb2_grpc.BatonStub(channel)
        call = stub.Generate(request(0, LONG_TOKENS), timeout=60)
        first = await call.read()
        assert first.token_ids
        gateway.popen.send_signal(signal.SIGTERM)
        checks = health_pb2_grpc.HealthStub(channel)
        while (
            await checks.Check(health_pb2.HealthCheckRequest(), timeout=5)
        ).status == health_pb2.HealthCheckResponse.SERVING:
            await asyncio.sleep(0.005)
        refused = await generate(stub, request(1), timeout=10)
        assert refused.code is grpc.StatusCode.UNAVAILABLE, refused
        assert "shutting down" in refused.details, refused  # refused by the draining gateway
        assert not call.done(), "the stream ended before the refusal; it proves nothing"
        rest = await collect(call)
    rest.responses.insert(0, first)
    assert_completed(rest, LONG_TOKENS, cluster.logs())
    # Its start is the short greedy continuation (HF over all of it would take long).
    ours = [t for r in rest.responses for t in r.token_ids][:MAX_TOKENS]
    ref, ref_logits = reference[0]
    assert compare_greedy(ours, ref, ref_logits) in ("equal", "tie"), f"{ours} vs HF {ref}"
    assert_clean_exit(gateway, await exit_code(gateway))
