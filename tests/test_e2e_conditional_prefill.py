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


def _decode_transfer_bytes(cluster: E2ECluster) -> tuple[float, float]:
    """The decode worker's KV bytes received and bytes not sent (held already)."""
    decode = next(p for p in cluster.procs if p.kind == "decode")
    text = urllib.request.urlopen(f"http://{decode.metrics_address}/metrics", timeout=5).read()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            found[sample.name] = sample.value
    return (
        found["baton_kv_transfer_bytes_total"],
        found["baton_kv_transfer_saved_bytes_total"],
    )


async def test_a_remote_prefill_sends_only_what_the_decode_worker_lacks(
    cluster: E2ECluster, tiny_llama: Path
) -> None:
    """A follow-up too new for local prefill (100 new tokens, 64 % held) goes to the
    prefill worker, and the decode worker that holds the conversation takes from it only
    the blocks past the prefix it holds (at least turn 1's 10 full prompt blocks of the
    follow-up's 18), and the tokens are still HF's."""
    first = prompt_ids(160, "reuse-turn-1")
    hf = hf_model(tiny_llama)
    async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
        stub = generate_pb2_grpc.BatonStub(channel)
        before = _prefills(cluster)
        outcome = await generate(stub, _request(first))
        assert_completed(outcome, TOKENS, cluster.logs())
        answer = [t for r in outcome.responses for t in r.token_ids]
        await asyncio.sleep(0.5)  # the decode worker's KV events reach the gateway
        moved, saved = _decode_transfer_bytes(cluster)
        follow_up = first + answer + prompt_ids(100, "reuse-turn-2")
        outcome = await generate(stub, _request(follow_up))
        assert_completed(outcome, TOKENS, cluster.logs())
        ours = [t for r in outcome.responses for t in r.token_ids]
        ref, logits = hf_greedy(hf, follow_up, TOKENS)
        assert compare_greedy(ours, ref, logits) in ("equal", "tie"), (ours, ref)
        after = _prefills(cluster)
        assert after["remote"] - before["remote"] == 2 and after["local"] == before["local"]
        moved_now, saved_now = _decode_transfer_bytes(cluster)
        moved, saved = moved_now - moved, saved_now - saved
        block = (moved + saved) / 18  # 276 tokens: 18 blocks, each sent or held
        assert saved >= 10 * block and moved <= 8 * block, (moved, saved)
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
