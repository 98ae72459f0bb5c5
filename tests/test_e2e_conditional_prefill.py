"""Conditional disaggregation through real processes: a short prompt, and a follow-up turn
the decode worker mostly holds, are prefilled on the decode worker itself; a long new one
goes to the prefill worker. Every path gives HF's greedy tokens (fp32, up to a near tie).

The tiny model, one prefill and one decode worker, the gateway with
``--local-prefill-tokens 48 --local-prefill-cached-fraction 0.8``. Where each prompt
was prefilled is read from the gateway's ``baton_prefills_total{where}``; the follow-up's
reuse from the decode worker's own prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest
from prometheus_client.parser import text_string_to_metric_families

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
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model

TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(
        tiny_llama,
        num_prefill=1,
        num_decode=1,
        gateway_args=("--local-prefill-tokens", "48", "--local-prefill-cached-fraction", "0.8"),
        metrics=True,
    ) as c:
        yield c


def _request(ids: list[int]) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParameters(
            max_tokens=TOKENS, temperature=0, ignore_eos=True
        ),
    )


def _prefills(cluster: E2ECluster) -> dict[str, float]:
    gateway = next(p for p in cluster.procs if p.kind == "gateway")
    text = urllib.request.urlopen(f"http://{gateway.metrics_address}/metrics", timeout=5).read()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name == "baton_prefills":
            for sample in family.samples:
                if sample.name == "baton_prefills_total":
                    out[sample.labels["where"]] = sample.value
    return out


async def _decode_hits(cluster: E2ECluster) -> int:
    (address,) = [a for kind, a in cluster.live_workers() if kind == "decode"]
    return (await worker_stats(address, "decode")).prefix_cache_hit_tokens


async def test_short_and_mostly_cached_prompts_are_prefilled_on_the_decode_worker(
    cluster: E2ECluster, tiny_llama: Path
) -> None:
    short = prompt_ids(30, "conditional-short")
    long = prompt_ids(160, "conditional-long")
    hf = hf_model(tiny_llama)
    async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
        stub = generate_pb2_grpc.BatonStub(channel)

        async def run(ids: list[int]) -> list[int]:
            outcome = await generate(stub, _request(ids))
            assert_completed(outcome, TOKENS, cluster.logs())
            ours = [t for r in outcome.responses for t in r.token_ids]
            ref, logits = hf_greedy(hf, ids, TOKENS)
            assert compare_greedy(ours, ref, logits) in ("equal", "tie"), (ours, ref)
            return ours

        await run(short)
        assert _prefills(cluster) == {"local": 1, "remote": 0}
        answer = await run(long)
        assert _prefills(cluster) == {"local": 1, "remote": 1}
        await asyncio.sleep(0.5)  # the decode worker's KV events reach the gateway
        before = await _decode_hits(cluster)
        follow_up = long + answer + prompt_ids(20, "conditional-turn-2")
        await run(follow_up)
        assert _prefills(cluster) == {"local": 2, "remote": 1}
        # The decode worker served the earlier turn's blocks from its own cache.
        assert await _decode_hits(cluster) - before >= 160
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
