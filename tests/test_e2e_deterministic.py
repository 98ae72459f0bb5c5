"""End to end through real processes: with ``--deterministic`` the bundled SmolLM2 in bf16
gives the same seeded tokens and logprobs, bit for bit, disaggregated over shm, over gloo
(the deployments ``baton serve --deterministic`` starts), and in one process.

The one-process reference is the engine that ``decode_service --single-process`` runs,
here in the test process with the same settings, all prompts in one batch: a third
deployment's processes would double the start-up, which loading the model dominates.
Both deployments start side by side and serve the prompts concurrently, so each prompt
shares its steps with other company in each."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from engine.kernels.cpu import cpu_kernels
from engine.model_files import ModelFiles
from engine.sampling_params import SamplingParams as EngineSampling
from gateway.launcher import ClusterSpec, LocalCluster
from protos.client import AsyncClient, SamplingParams
from tests.engine_helpers import make_core

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_kernels() is None, reason="deterministic mode needs the CPU kernels"),
]

# The user's trial in the issue: seeded nucleus sampling.
SAMPLING = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "logprobs": 2}
WORKER_ARGS = ("--num-blocks", "512", "--max-num-seqs", "16")

Output = tuple[list[int], list[tuple[int, float, tuple[tuple[int, float], ...]]]]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(22)
    # Past one 16-token block; the last past the 256-token KV split.
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in (20, 45, 90, 270)]


def _one_process(model: ModelFiles, prompts: list[list[int]]) -> list[Output]:
    core = make_core(model.path, dtype="bfloat16", deterministic=True, num_blocks=512,
                     max_num_seqs=16)  # fmt: skip
    params = EngineSampling(ignore_eos=True, **SAMPLING)
    outputs: dict[str, Output] = {f"r{i}": ([], []) for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        core.add_request(core.make_request(f"r{i}", prompt, params))
    while core.has_work():
        for out in core.step():
            tokens, logprobs = outputs[out.request_id]
            tokens.extend(out.new_token_ids)
            logprobs.extend((lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.logprobs or [])
    core.runner.close()
    return list(outputs.values())


@pytest.fixture(scope="module")
def deployments(
    smollm2: ModelFiles, prompts: list[list[int]]
) -> Iterator[tuple[dict[str, LocalCluster], list[Output]]]:
    specs = {
        transport: ClusterSpec(
            model=str(smollm2.path),
            transport=transport,
            dtype="bfloat16",
            deterministic=True,
            worker_args=WORKER_ARGS,
            # Every prompt prefilled on the prefill worker: the split under test.
            gateway_args=("--local-prefill-tokens", "0"),
        )
        for transport in ("shm", "gloo")
    }
    with ExitStack() as stack, ThreadPoolExecutor(len(specs) + 1) as pool:
        reference = pool.submit(_one_process, smollm2, prompts)
        started = {name: pool.submit(LocalCluster(spec).__enter__) for name, spec in specs.items()}
        failed: list[BaseException] = []
        for future in started.values():  # every started deployment is stopped, whatever fails
            try:
                stack.push(future.result().__exit__)
            except Exception as exc:  # noqa: BLE001 - raised below, after the others are held
                failed.append(exc)
        if failed:
            raise failed[0]
        yield {name: f.result() for name, f in started.items()}, reference.result()


async def _served(address: str, prompts: list[list[int]]) -> list[Output]:
    sampling = SamplingParams(ignore_eos=True, **SAMPLING)

    async def one(client: AsyncClient, prompt: list[int]) -> Output:
        tokens: list[int] = []
        logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = []
        async for chunk in client.generate(token_ids=prompt, sampling=sampling, timeout=120):
            tokens.extend(chunk.token_ids)
            logprobs.extend((lp.token_id, lp.logprob, lp.top) for lp in chunk.logprobs)
        return tokens, logprobs

    async with AsyncClient(address) as client:
        return await asyncio.gather(*[one(client, p) for p in prompts])


def test_seeded_bf16_output_is_the_same_bits_split_or_not(
    deployments: tuple[dict[str, LocalCluster], list[Output]], prompts: list[list[int]]
) -> None:
    clusters, one_process = deployments

    async def run() -> list[list[Output]]:
        calls = [_served(c.gateway_address, prompts) for c in clusters.values()]
        return await asyncio.gather(*calls)

    served = dict(zip(clusters, asyncio.run(run()), strict=True))
    for tokens, logprobs in one_process:
        assert len(tokens) == len(logprobs) == SAMPLING["max_tokens"]
    for name, outputs in served.items():
        for i, (ours, ref) in enumerate(zip(outputs, one_process, strict=True)):
            assert ours[0] == ref[0], f"{name}: prompt {i}: tokens differ"
            assert ours[1] == ref[1], f"{name}: prompt {i}: logprobs differ"
