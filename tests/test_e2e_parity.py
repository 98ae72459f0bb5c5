"""End to end through real processes on loopback: greedy output through the gateway equals
HF ``generate`` token for token, disaggregated over shm and gloo and single-process."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest

from engine.model_files import ModelFiles
from gateway.launcher import ClusterSpec, LocalCluster
from protos.client import AsyncClient, FinishReason, SamplingParams
from tests.engine_helpers import compare_greedy, hf_greedy_many, hf_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
NUM_STREAMS = 32


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [
        [rng.randrange(1000, 40000) for _ in range(rng.randint(4, 120))] for _ in range(NUM_STREAMS)
    ]


@pytest.fixture(scope="module")
def reference(smollm2: ModelFiles, prompts: list[list[int]]) -> list[tuple[list[int], Any]]:
    hf = hf_model(smollm2.path)
    return hf_greedy_many(hf, prompts, NEW_TOKENS)


@pytest.fixture(
    scope="module",
    params=[("disaggregated", "shm"), ("disaggregated", "gloo"), ("single", "shm")],
    ids=["disagg-shm", "disagg-gloo", "single-process"],
)
def cluster(request: pytest.FixtureRequest, smollm2: ModelFiles) -> Iterator[LocalCluster]:
    mode, transport = request.param
    spec = ClusterSpec(
        model=str(smollm2.path),
        mode=mode,
        transport=transport,
        dtype="float32",
        worker_args=("--num-blocks", "1024", "--max-num-seqs", "32"),
    )
    with LocalCluster(spec) as c:
        yield c


async def _tokens(client: AsyncClient, prompt: list[int]) -> tuple[list[int], Any]:
    out: list[int] = []
    last = None
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    async for r in client.generate(token_ids=prompt, sampling=sampling, timeout=120):
        out.extend(r.token_ids)
        last = r
    return out, last


def test_greedy_equals_hf_for_32_concurrent_streams(
    cluster: LocalCluster, prompts: list[list[int]], reference: list[tuple[list[int], Any]]
) -> None:
    async def run() -> list[tuple[list[int], Any]]:
        async with AsyncClient(cluster.gateway_address) as client:
            return await asyncio.gather(*[_tokens(client, p) for p in prompts])

    results = asyncio.run(run())
    verdicts = [
        compare_greedy(ours, ref, logits)
        for (ours, _), (ref, logits) in zip(results, reference, strict=True)
    ]
    print(f"equal={verdicts.count('equal')} ties={verdicts.count('tie')} of {len(verdicts)}")
    assert "mismatch" not in verdicts, verdicts
    assert verdicts.count("tie") <= 2, verdicts
    for (tokens, last), prompt in zip(results, prompts, strict=True):
        assert last.finish_reason == FinishReason.LENGTH
        assert last.usage.prompt_tokens == len(prompt)
        assert last.usage.completion_tokens == len(tokens) == NEW_TOKENS


SEEDED = 8


@pytest.fixture(scope="module")
def seeded_reference(smollm2: ModelFiles, prompts: list[list[int]]) -> list[list[int]]:
    """Seeded sampled continuations from one in-process engine: since seeded sampling is
    a function of (seed, output position), every deployment must reproduce them."""
    from engine.sampling_params import SamplingParams as EngineParams
    from tests.engine_helpers import make_core

    core = make_core(smollm2.path)
    params = [
        EngineParams(
            max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True
        )
        for i in range(SEEDED)
    ]
    return core.generate(prompts[:SEEDED], params)


def test_seeded_sampling_is_the_same_in_every_deployment(
    cluster: LocalCluster, prompts: list[list[int]], seeded_reference: list[list[int]]
) -> None:
    async def one(client: AsyncClient, i: int) -> list[int]:
        sampling = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True
        )
        out: list[int] = []
        async for r in client.generate(token_ids=prompts[i], sampling=sampling, timeout=120):
            out.extend(r.token_ids)
        return out

    async def run() -> list[list[int]]:
        async with AsyncClient(cluster.gateway_address) as client:
            return await asyncio.gather(*[one(client, i) for i in range(SEEDED)])

    assert asyncio.run(run()) == seeded_reference
