"""``n`` choices on a decode worker (decode_service.choices): choice 0 runs as the request
would alone, the others start once its first token is out and share the prompt's KV
blocks through the prefix cache; each choice is seeded ``seed + i``; closing the merged
stream aborts every choice. Driven on fake streams and on the tiny model's AsyncEngine
(the path the Decode servicer takes), without gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from decode_service.choices import fan_out
from engine.async_engine import AsyncEngine
from engine.request import FinishReason, RequestOutput, TokenLogprob
from engine.sampling_params import MAX_N, SamplingParams
from gateway.http.request import Endpoint, parse_request
from gateway.http.response import ResponseBuilder
from gateway.served_model import ServedModel
from gateway.text.output_processor import GenerateDelta
from gateway.text.output_processor import Usage as OutputUsage
from protos.baton.v1 import common_pb2, generate_pb2
from protos.client.messages import Chunk, Completion, Usage
from protos.client.messages import FinishReason as ClientFinish
from protos.client.messages import SamplingParams as ClientSamplingParams
from tests.engine_helpers import make_core
from tests.fake_workers import FakeDecodeWorker, Script, fake_workers
from tests.http_helpers import MODEL, ids_of, running_http
from tests.test_openai_request import CARD
from tests.test_seeded_split import PROMPT

BLOCK = 16


async def _script(name: str, n: int, log: list[str]) -> AsyncIterator[RequestOutput]:
    try:
        for i in range(n):
            log.append(f"{name}{i}")
            last = i == n - 1
            yield RequestOutput(name, [i], finish_reason=FinishReason.LENGTH if last else None)
            await asyncio.sleep(0)
    finally:
        log.append(f"{name} closed")


def test_choice_params_seed_each_choice_as_vllm_does() -> None:
    params = SamplingParams(n=3, seed=7, temperature=1.0, prompt_logprobs=1)
    assert [params.choice(i).seed for i in range(3)] == [7, 8, 9]
    assert all(params.choice(i).n == 1 for i in range(3))
    assert [params.choice(i).prompt_logprobs for i in range(3)] == [1, None, None]
    assert SamplingParams(n=2).choice(1).seed is None
    with pytest.raises(ValueError, match=f"n must be <= {MAX_N}"):
        SamplingParams(n=MAX_N + 1)
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match=r"seed \+ n - 1 must be < 2\*\*63"):
        SamplingParams(n=2, seed=2**63 - 1)


async def test_the_others_start_after_choice_0s_first_output() -> None:
    log: list[str] = []
    started: list[int] = []

    def start(i: int) -> AsyncIterator[RequestOutput]:
        started.append(i)
        log.append(f"start {i}")
        return _script(f"c{i}", 2, log)

    outs = [o async for o in fan_out(_script("c0", 3, log), start, 3)]
    assert started == [1, 2]
    assert log.index("start 1") > log.index("c00")
    by_index = {i: [t for o in outs if o.index == i for t in o.new_token_ids] for i in range(3)}
    assert by_index == {0: [0, 1, 2], 1: [0, 1], 2: [0, 1]}
    assert sum(o.finished for o in outs) == 3


async def test_closing_the_stream_closes_every_choice() -> None:
    log: list[str] = []
    merged = fan_out(_script("c0", 100, log), lambda i: _script(f"c{i}", 100, log), 3)
    async with contextlib.aclosing(merged):
        seen = {(await anext(merged)).index for _ in range(12)}
    assert seen == {0, 1, 2}
    assert {"c0 closed", "c1 closed", "c2 closed"} <= set(log)


async def test_an_error_in_one_choice_ends_the_stream() -> None:
    async def broken() -> AsyncIterator[RequestOutput]:
        raise ValueError("choice 1 failed")
        yield  # pragma: no cover

    log: list[str] = []
    with pytest.raises(ValueError, match="choice 1 failed"):
        async for _ in fan_out(_script("c0", 50, log), lambda i: broken(), 2):
            pass
    assert "c0 closed" in log


async def test_choices_share_the_prompts_kv_blocks(tiny_llama: Path) -> None:
    engine = AsyncEngine(make_core(tiny_llama, num_blocks=64))
    await engine.start()
    try:
        choices = SamplingParams(n=3, max_tokens=10, temperature=0, ignore_eos=True)

        def start(i: int) -> AsyncIterator[RequestOutput]:
            return engine.generate(f"r/{i}", PROMPT * 2, choices.choice(i))

        total = engine.stats().num_total_blocks
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        used = 0
        merged = fan_out(start(0), start, 3)
        async with contextlib.aclosing(merged):
            async for out in merged:
                tokens[out.index].extend(out.new_token_ids)
                if all(0 < len(t) < 10 for t in tokens.values()):  # all three running
                    used = max(used, total - engine.stats().num_free_blocks)
        # 36 prompt tokens + 10: 3 blocks for one request alone. Choices: the 2 full
        # prompt blocks shared, a third block each.
        assert len(PROMPT * 2) == 36
        one = -(-(36 + 10) // BLOCK)
        assert used == 2 + 3 < 3 * one
        # Greedy: the same tokens three times.
        assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 10
    finally:
        await engine.shutdown()


def test_the_python_client_asks_for_n_and_reads_the_index() -> None:
    assert ClientSamplingParams(n=3).to_proto().n == 3
    lp = common_pb2.TokenLogprob(token_id=4, logprob=-0.5, rank=1)
    chunk = Chunk.from_proto(
        generate_pb2.GenerateResponse(request_id="r", index=2, prompt_logprobs=[lp])
    )
    assert chunk.index == 2 and [p.token_id for p in chunk.prompt_logprobs] == [4]
    last = dataclasses.replace(
        chunk, finish_reason=ClientFinish.LENGTH, usage=Usage(3, 1, 0), prompt_logprobs=()
    )
    with pytest.raises(ValueError, match="read its chunks by their index"):
        Completion.from_chunks([last])


def test_an_openai_response_lists_each_choice_and_echoes_each() -> None:
    body = {"model": "m", "prompt": [5, 6, 7], "n": 2, "echo": True, "logprobs": 0}
    req = parse_request(Endpoint.COMPLETIONS, body, CARD, None)
    assert req.input.params.n == 2 and req.input.params.prompt_logprobs == 0
    builder = ResponseBuilder(req, "r", 0, lambda t: f"<{t}>", prompt_text="<5><6><7>")
    lp = [TokenLogprob(6, -1.0, 1, []), TokenLogprob(7, -2.0, 1, [])]
    first = GenerateDelta([9], "<9>", [TokenLogprob(9, -0.5, 1, [])], index=0)
    first.prompt_token_ids, first.prompt_logprobs = [5, 6, 7], lp
    other = GenerateDelta([8], "<8>", [TokenLogprob(8, -0.25, 1, [])], index=1)
    other.finish_reason = FinishReason.LENGTH
    last = GenerateDelta([], "", [], finish_reason=FinishReason.LENGTH, index=0, last=True)
    last.usage = OutputUsage(prompt_tokens=3, completion_tokens=2)
    streamed = [c for d in (first, other, last) for c in builder.chunks(d)]
    assert [c["choices"][0]["index"] for c in streamed] == [0, 1, 0]
    assert streamed[1]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -0.25]
    whole_builder = ResponseBuilder(req, "r", 0, lambda t: f"<{t}>", prompt_text="<5><6><7>")
    for d in (first, other, last):
        whole_builder.add(d)
    whole = whole_builder.response()
    assert [c["text"] for c in whole["choices"]] == ["<5><6><7><9>", "<5><6><7><8>"]
    assert [c["finish_reason"] for c in whole["choices"]] == ["length", "length"]
    assert whole["choices"][1]["logprobs"]["tokens"] == ["<5>", "<6>", "<7>", "<8>"]
    assert whole["choices"][1]["logprobs"]["text_offset"] == [0, 3, 6, 9]
    assert whole["usage"]["completion_tokens"] == 2


async def test_one_choice_passes_through_and_is_closed_with_the_stream() -> None:
    log: list[str] = []
    merged = fan_out(_script("c0", 100, log), lambda i: _script(f"c{i}", 1, log), 1)
    async with contextlib.aclosing(merged):
        assert (await anext(merged)).index == 0
    assert log == ["c00", "c0 closed"]


async def test_the_gateway_shapes_n_choices_and_ends_each_on_its_own(
    served_smollm2: ServedModel,
) -> None:
    words = [" hello world", " stop here now", " ok"]
    per_choice = [ids_of(served_smollm2, w) for w in words]
    decode = FakeDecodeWorker()
    decode.script = Script(
        choice_token_ids=per_choice, finish_reason=common_pb2.FINISH_REASON_LENGTH
    )
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        whole = await gw.client.completions.create(model=MODEL, prompt="x", n=3, stop=["here"])
        stream = await gw.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, stream=True
        )
        chunks = [c async for c in stream]
    assert decode.requests[0].sampling_params.n == 3
    assert [c.text for c in whole.choices] == [" hello world", " stop ", " ok"]
    assert [c.finish_reason for c in whole.choices] == ["length", "stop", "length"]
    shown = len(per_choice[0]) + len(per_choice[2])
    assert shown < whole.usage.completion_tokens < shown + len(per_choice[1])
    texts = {i: "" for i in range(3)}
    finishes = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == dict(enumerate(words))
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices[0].finish_reason is not None  # the stream ends with a finish
