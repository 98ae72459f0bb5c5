"""Serving on one GPU through real processes: prefill and decode workers handing KV over
cuda_ipc (two processes, one GPU), and a single-process GPU worker; greedy output
through the gateway equals HF token for token (ties allowed as in test_e2e_parity).
Marked ``gpu``; skipped without CUDA."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.launcher import ClusterSpec, LocalCluster
from protos.client import AsyncClient, SamplingParams
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEW_TOKENS = 8
STREAMS = 8


async def _tokens(client: AsyncClient, prompt: list[int]) -> list[int]:
    out: list[int] = []
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    async for r in client.generate(token_ids=prompt, sampling=sampling, timeout=120):
        out.extend(r.token_ids)
    return out


@pytest.mark.parametrize(("mode", "transport"), [("disaggregated", "cuda_ipc"), ("single", "shm")])
def test_gpu_serving_is_greedy_equal_to_hf(tiny_llama: Path, mode: str, transport: str) -> None:
    rng = random.Random(3)
    prompts = [
        [rng.randrange(1000, 40000) for _ in range(rng.randint(4, 60))] for _ in range(STREAMS)
    ]
    spec = ClusterSpec(
        model=str(tiny_llama),
        mode=mode,
        transport=transport,
        dtype="float32",
        worker_args=("--device", "cuda:0", "--num-blocks", "512", "--max-num-seqs", "16"),
        start_timeout_s=300.0,
    )

    async def run(address: str) -> list[list[int]]:
        async with AsyncClient(address) as client:
            return await asyncio.gather(*[_tokens(client, p) for p in prompts])

    with LocalCluster(spec) as cluster:
        results = asyncio.run(run(cluster.gateway_address))
    hf = hf_model(tiny_llama)
    reference: list[Any] = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    verdicts = [
        compare_greedy(ours, ref, logits)
        for ours, (ref, logits) in zip(results, reference, strict=True)
    ]
    assert "mismatch" not in verdicts, verdicts
