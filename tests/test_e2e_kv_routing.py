"""Cache-aware routing through real processes: follow-up turns of a conversation go to the
prefill worker that holds its earlier turns.

One gateway, two prefill workers and a decode worker of the tiny model. Six conversations
open at once (so their first turns spread over both prefill workers); then each sends two
follow-up turns, one at a time, each extending the previous prompt. Every follow-up is
prefilled where the conversation's blocks are, which the prefill workers' own prefix-cache
hit counts show: all of each follow-up's earlier full blocks were hits. (Routed by load
alone, the idle workers tie and every follow-up goes to the first one, which holds only
the conversations it happened to get.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest

from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e_helpers import (
    E2ECluster,
    assert_completed,
    generate,
    prompt_ids,
    tiny_cluster,
    wait_settled,
    worker_stats,
)

BLOCK = 16  # the workers' default block size
CONVERSATIONS = 6
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(tiny_llama, num_prefill=2, num_decode=1) as c:
        yield c


def _request(ids: list[int]) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParameters(
            max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
        ),
    )


async def _hits(cluster: E2ECluster) -> int:
    total = 0
    for kind, address in cluster.live_workers():
        if kind == "prefill":
            total += (await worker_stats(address, "prefill")).prefix_cache_hit_tokens
    return total


async def test_follow_up_turns_go_where_the_conversation_is_cached(cluster: E2ECluster) -> None:
    turns = [[prompt_ids(8 * BLOCK, f"conv-{c}")] for c in range(CONVERSATIONS)]  # 128 tokens each
    async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
        stub = generate_pb2_grpc.BatonStub(channel)
        firsts = await asyncio.gather(*(generate(stub, _request(t[0])) for t in turns))
        for outcome in firsts:
            assert_completed(outcome, MAX_TOKENS, cluster.logs())
        expected = 0
        for turn in range(1, 3):
            for c, history in enumerate(turns):
                prompt = history[-1] + prompt_ids(2 * BLOCK, f"conv-{c}-turn-{turn}")
                before = await _hits(cluster)
                await asyncio.sleep(0.3)  # the gateway has the workers' latest KV events
                assert_completed(await generate(stub, _request(prompt)), MAX_TOKENS)
                got = await _hits(cluster) - before
                want = len(history[-1]) // BLOCK * BLOCK
                assert got >= want, f"conversation {c} turn {turn}: {got} of {want} hit"
                expected += want
                history.append(prompt)
    assert expected > 0
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
