"""What a new user does to a disaggregated deployment of the bundled model with default
flags (bf16, shm): a prompt near ``max_model_len``, short requests sent while it
prefills, and 96 requests kept 16 in flight, some cancelled by their clients.

Before the hand-off was bounded by progress and Stats came from a snapshot, the long
prompt failed after 30 s with DEADLINE_EXCEEDED, took the prefill worker "down" with it,
and 40 of 88 uncancelled requests at 16 in flight failed with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import grpc
import pytest

from engine.model_files import ModelFiles
from gateway.launcher import ClusterSpec, LocalCluster
from protos.baton.v1 import common_pb2, generate_pb2
from tests.e2e_helpers import (
    assert_completed,
    collect,
    gateway_stub,
    generate,
    prompt_ids,
    wait_settled,
)

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 8192  # SmolLM2's


@pytest.fixture(scope="module")
def cluster(smollm2: ModelFiles) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model=str(smollm2.path), log_level="INFO")  # defaults, as a user runs it
    with LocalCluster(spec) as c:
        yield c


def _request(n: int, label: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt_ids(n, label)),
        sampling_params=common_pb2.SamplingParameters(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
    )


def _workers(cluster: LocalCluster) -> list[tuple[str, str]]:
    return [(k, a) for k in ("prefill", "decode") for a in cluster.addresses(k)]


def test_a_prompt_near_max_model_len_and_requests_sent_during_its_prefill(
    cluster: LocalCluster,
) -> None:
    async def run() -> None:
        async with gateway_stub(cluster.gateway_address) as stub:
            began = time.monotonic()
            long = asyncio.create_task(
                generate(stub, _request(MAX_MODEL_LEN - 8, "long", 4), timeout=600)
            )
            await asyncio.sleep(5.0)  # well into its prefill
            shorts = await asyncio.gather(
                *(generate(stub, _request(60, f"short-{i}", 8), timeout=600) for i in range(3))
            )
            long_outcome = await long
            print(f"long prompt: {long_outcome} ({time.monotonic() - began:.1f} s)")
            assert_completed(long_outcome, 4, cluster.logs())
            for outcome in shorts:
                assert_completed(outcome, 8, cluster.logs())
            # The worker was busy, never down: a normal request right after is served.
            assert_completed(await generate(stub, _request(30, "after", 4)), 4, cluster.logs())
        await wait_settled(_workers(cluster), logs=cluster.logs)

    asyncio.run(run())


def test_96_requests_at_16_in_flight_with_cancellations(cluster: LocalCluster) -> None:
    rng = random.Random(16)
    # 6 waves of 16 in flight; 11 cancelled by their clients after the first token
    jobs = [(rng.randint(20, 200), rng.randint(2, 6), i % 9 == 4) for i in range(96)]

    async def one(stub, i: int, n: int, max_tokens: int, cancel: bool):  # noqa: ANN001, ANN202
        call = stub.Generate(_request(n, f"load-{i}", max_tokens), timeout=300)
        if not cancel:
            return await collect(call)
        # The client gives up after its first token.
        await call.read()
        call.cancel()
        return None

    async def run() -> list:
        async with gateway_stub(cluster.gateway_address) as stub:
            gate = asyncio.Semaphore(16)

            async def bounded(i: int, job: tuple[int, int, bool]):  # noqa: ANN202
                async with gate:
                    return await one(stub, i, *job)

            return await asyncio.gather(*(bounded(i, job) for i, job in enumerate(jobs)))

    began = time.monotonic()
    outcomes = asyncio.run(run())
    failures = [
        (i, str(o))
        for i, o in enumerate(outcomes)
        if o is not None and o.code is not grpc.StatusCode.OK
    ]
    completed = sum(1 for o in outcomes if o is not None and o.code is grpc.StatusCode.OK)
    print(f"{completed} completed, {sum(j[2] for j in jobs)} cancelled by their clients, "
          f"{len(failures)} failed, in {time.monotonic() - began:.1f} s")
    assert not failures, f"{len(failures)} failed, e.g. {failures[:3]}\n{cluster.logs()}"
    for o, (_, max_tokens, cancel) in zip(outcomes, jobs, strict=True):
        if not cancel:
            assert_completed(o, max_tokens)
    asyncio.run(wait_settled(_workers(cluster), logs=cluster.logs))
