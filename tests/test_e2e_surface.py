"""The rest of the OpenAI surface through a real disaggregated deployment (gateway, prefill
and decode workers as processes, shm, tiny model in fp32): ``logit_bias`` of -100 bans
tokens the model would pick, on the prefill worker's first token and on decode's; ``echo``
with ``logprobs`` returns the prompt with HF's log-probabilities, also when the prompt's
KV is already in the prefill worker's prefix cache, and with ``max_tokens: 0`` the prompt
alone (no generated token); ``n=3`` gives three choices from one
prefill (greedy: identical; seeded: as three single requests seeded seed + i), streamed
with their index, over HTTP and gRPC, and a client leaving mid-stream frees every block.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from protos.baton.v1 import common_pb2, generate_pb2
from tests.e2e_helpers import (
    E2ECluster,
    gateway_stub,
    generate,
    prompt_ids,
    tiny_cluster,
    wait_settled,
)
from tests.engine_helpers import hf_model

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(tiny_llama, http_port=0) as c:
        yield c


async def _tokens(cluster: E2ECluster, ids: list[int], **sampling: object) -> tuple[list[int], str]:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParameters(
            max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **sampling
        ),
    )
    async with gateway_stub(cluster.gateway_address) as stub:
        outcome = await generate(stub, request)
    tokens = [t for r in outcome.responses for t in r.token_ids]
    return tokens, "".join(r.text for r in outcome.responses)


async def test_the_openai_surface_through_the_split(cluster: E2ECluster, tiny_llama: Path) -> None:
    """One deployment, started once, for all three (the one test here with processes)."""
    await _logit_bias_and_echo(cluster, tiny_llama)
    await _n_choices_from_one_prefill(cluster)


async def _logit_bias_and_echo(cluster: E2ECluster, tiny_llama: Path) -> None:
    ids = prompt_ids(40, "surface")
    free, _ = await _tokens(cluster, ids)
    # free[0] is sampled by the prefill worker, free[2] by the decode worker.
    banned = {free[0]: -100.0, free[2]: -100.0}
    biased, biased_text = await _tokens(cluster, ids, logit_bias=banned)
    assert len(biased) == MAX_TOKENS and not set(banned) & set(biased)
    assert biased[0] != free[0]

    client = openai.AsyncOpenAI(
        base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=60
    )
    async with client:
        (model,) = (await client.models.list()).data
        over_http = await client.completions.create(
            model=model.id,
            prompt=ids,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logit_bias={str(t): b for t, b in banned.items()},
            extra_body={"ignore_eos": True},
        )
        echoed = [
            await client.completions.create(
                model=model.id, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=2
            )
            for _ in range(2)  # the second finds the prompt in prefill's prefix cache
        ]
        # Log-likelihood: echo with max_tokens 0, the prompt alone, whole and streamed.
        zero = {"model": model.id, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0}
        prompt_only = await client.completions.create(**zero)
        streamed = [c async for c in await client.completions.create(**zero, stream=True)]
    assert over_http.choices[0].text == biased_text  # the HTTP edge maps it the same

    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(tiny_llama)(torch.tensor([ids])).logits[0].float(), -1)
    expected = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    for whole in echoed:
        got = whole.choices[0].logprobs
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        assert got.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        assert all(len(top) <= 2 for top in got.top_logprobs[1 : len(ids)])
        assert len(got.tokens) == len(ids) + 2
    assert echoed[1].usage.prompt_tokens == len(ids)

    only = prompt_only.choices[0]
    assert only.finish_reason == "length" and prompt_only.usage.completion_tokens == 0
    assert only.logprobs.tokens == echoed[0].choices[0].logprobs.tokens[: len(ids)]
    assert only.logprobs.token_logprobs[0] is None
    assert only.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert echoed[0].choices[0].text.startswith(only.text) and only.text
    assert "".join(c.choices[0].text for c in streamed if c.choices) == only.text
    assert streamed[-1].choices[0].finish_reason == "length"


async def _n_choices_from_one_prefill(cluster: E2ECluster) -> None:
    ids = prompt_ids(40, "choices")
    client = openai.AsyncOpenAI(
        base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=60
    )
    sampled = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    async with client:
        (model,) = (await client.models.list()).data
        greedy = await client.completions.create(
            model=model.id, prompt=ids, n=3, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        seeded = await client.completions.create(model=model.id, prompt=ids, n=3, seed=7, **sampled)
        singles = [
            await client.completions.create(model=model.id, prompt=ids, seed=7 + i, **sampled)
            for i in range(3)
        ]
        stream = await client.completions.create(
            model=model.id, prompt=ids, n=3, seed=7, stream=True, **sampled
        )
        parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
        finishes = {}
        async for chunk in stream:
            for c in chunk.choices:
                parts[c.index].append(c.text)
                if c.finish_reason is not None:
                    finishes[c.index] = c.finish_reason
        # A client that leaves mid-stream: every choice is aborted, every block freed.
        long = {**sampled, "max_tokens": 200}
        leaving = await client.completions.create(
            model=model.id, prompt=ids, n=3, stream=True, **long
        )
        async for _ in leaving:
            break
        await leaving.close()
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
    async with gateway_stub(cluster.gateway_address) as stub:
        grpc_n = await generate(
            stub,
            generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=ids),
                sampling_params=common_pb2.SamplingParameters(
                    max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, n=2
                ),
            ),
        )
    texts = [c.text for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert texts[0] and texts == [texts[0]] * 3  # greedy: the same three times
    assert greedy.usage.prompt_tokens == len(ids)  # one prompt
    assert greedy.usage.completion_tokens == 3 * MAX_TOKENS
    # Seeded: choice i draws what a single request seeded 7 + i does.
    assert [c.text for c in seeded.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in seeded.choices}) > 1
    assert ["".join(parts[i]) for i in range(3)] == [c.text for c in seeded.choices]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    per_choice = [
        [t for r in grpc_n.responses if r.index == i for t in r.token_ids] for i in (0, 1)
    ]
    assert per_choice[0] == per_choice[1] and len(per_choice[0]) == MAX_TOKENS
    assert grpc_n.responses[-1].usage.completion_tokens == 2 * MAX_TOKENS
    assert "".join(r.text for r in grpc_n.responses if r.index == 0) == texts[0]
