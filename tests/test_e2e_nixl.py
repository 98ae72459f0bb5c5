"""End to end over the nixl transport: 2 prefill and 2 decode workers of the tiny model as
real processes on loopback, KV moved by NIXL (UCX shared memory / TCP).

fp32 greedy output through the gateway equals HF ``generate`` token for token; 200
requests kept 16 in flight, every fourth cancelled by its client after its first token,
leave every other one complete and every block free on every worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.transfer.nixl_agent import INSTALL_HINT, nixl_available
from tests.e2e_helpers import (
    E2ECluster,
    assert_completed,
    collect,
    gateway_stub,
    ids_request,
    prompt_ids,
    tiny_cluster,
    wait_settled,
)
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason=f"nixl_cu12 is not importable: {INSTALL_HINT}"),
]

NEW_TOKENS = 10
NUM_PARITY = 8
REQUESTS = 200
IN_FLIGHT = 16
CANCEL_EVERY = 4  # every fourth request is cancelled after its first token


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(
        tiny_llama, num_prefill=2, num_decode=2, worker_args=("--transport", "nixl")
    ) as c:
        yield c


async def test_greedy_over_nixl_equals_hf(cluster: E2ECluster, tiny_llama: Path) -> None:
    labels = [f"nixl-parity-{i}" for i in range(NUM_PARITY)]
    lengths = [5 + 13 * i for i in range(NUM_PARITY)]  # 1 to 7 blocks of KV each
    async with gateway_stub(cluster.gateway_address) as stub:
        outcomes = await asyncio.gather(
            *[
                collect(stub.Generate(ids_request(n, label, max_tokens=NEW_TOKENS), timeout=120))
                for n, label in zip(lengths, labels, strict=True)
            ]
        )
    hf = hf_model(tiny_llama)
    for outcome, n, label in zip(outcomes, lengths, labels, strict=True):
        assert_completed(outcome, NEW_TOKENS, cluster.logs())
        ours = [t for r in outcome.responses for t in r.token_ids]
        ref, logits = hf_greedy(hf, prompt_ids(n, label), NEW_TOKENS)
        assert compare_greedy(ours, ref, logits) != "mismatch", (label, ours, ref)
    await wait_settled(cluster.live_workers(), logs=cluster.logs)


async def test_200_requests_at_16_in_flight_with_cancels_complete_and_leak_nothing(
    cluster: E2ECluster,
) -> None:
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(stub, i: int):  # noqa: ANN001, ANN202
        async with gate:
            return await _one(stub, i)

    async def _one(stub, i: int):  # noqa: ANN001, ANN202
        call = stub.Generate(
            ids_request(20 + 7 * (i % 9), f"nixl-burst-{i}", max_tokens=NEW_TOKENS), timeout=120
        )
        if i % CANCEL_EVERY == 0:
            first = await call.read()  # the first token: the KV hand-off is under way or done
            assert first is not grpc.aio.EOF and len(first.token_ids) >= 1
            assert call.cancel()
            return await call.code()
        return await collect(call)

    async with gateway_stub(cluster.gateway_address) as stub:
        outcomes = await asyncio.gather(*[one(stub, i) for i in range(REQUESTS)])
    for i, outcome in enumerate(outcomes):
        if i % CANCEL_EVERY == 0:
            assert outcome is grpc.StatusCode.CANCELLED, outcome
        else:
            assert_completed(outcome, NEW_TOKENS, cluster.logs())
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
