"""The OpenAI-compatible HTTP API end to end: the official ``openai`` client against a real
deployment (gateway, prefill and decode workers as processes on loopback, tiny model).

Greedy output over HTTP (chat and completions, streaming and not) equals the gRPC path's
for the same request; refused fields and bad values come back as OpenAI errors naming the
field; a client that disconnects mid-stream leaves every KV block free on both workers.
Structured output (JSON schemas, regex, choice) and tool calls over both APIs, with the
constraint applied on both sides of the prefill/decode split.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from protos.baton.v1 import common_pb2, generate_pb2
from tests.e2e_helpers import (
    E2ECluster,
    describe,
    gateway_stub,
    generate,
    prompt_ids,
    tiny_cluster,
    wait_settled,
    worker_stats,
)
from tests.structured_cases import SCHEMAS, WEATHER, validate
from tests.test_openai_request import REFUSED, Endpoint

MAX_TOKENS = 12
DECODE_BLOCKS = 128


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(
        tiny_llama, decode_args=("--num-blocks", str(DECODE_BLOCKS)), http_port=0
    ) as c:
        yield c


def client_for(cluster: E2ECluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=60
    )


async def model_id(client: openai.AsyncOpenAI) -> str:
    (model,) = (await client.models.list()).data
    return model.id


GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


async def grpc_text(cluster: E2ECluster, request: generate_pb2.GenerateRequest) -> tuple[str, int]:
    request.sampling_params.CopyFrom(
        common_pb2.SamplingParameters(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    async with gateway_stub(cluster.gateway_address) as stub:
        outcome = await generate(stub, request)
    assert outcome.num_tokens == MAX_TOKENS, str(outcome)
    return "".join(r.text for r in outcome.responses), outcome.responses[-1].usage.prompt_tokens


async def test_greedy_completions_equal_the_grpc_path(cluster: E2ECluster) -> None:
    ids = prompt_ids(24, "completions")
    expected, _ = await grpc_text(
        cluster, generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids))
    )
    client = client_for(cluster)
    async with client:
        model = await model_id(client)
        whole = await client.completions.create(
            model=model, prompt=ids, max_tokens=MAX_TOKENS, **GREEDY
        )
        stream = await client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = [c async for c in stream]
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (24, MAX_TOKENS)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


async def test_greedy_chat_equals_the_grpc_path(cluster: E2ECluster) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a relay race leg."},
    ]
    chat = generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    )
    expected, prompt_tokens = await grpc_text(cluster, generate_pb2.GenerateRequest(chat=chat))
    client = client_for(cluster)
    async with client:
        model = await model_id(client)
        whole = await client.chat.completions.create(
            model=model, messages=messages, max_completion_tokens=MAX_TOKENS, **GREEDY
        )
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, stream=True, **GREEDY
        )
        chunks = [c async for c in stream]
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == prompt_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_the_gateway_renders_chat_as_transformers_without_loading_torch(
    cluster: E2ECluster, tiny_llama: Path
) -> None:
    """The gateway reads the tokenizer without transformers (gateway.text.tokenizer_json):
    the chat's prompt is HF's ``apply_chat_template`` of it, token for token, and the
    gateway process never maps torch."""
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": "Réponds en un mot <b>&</b>."},
        {"role": "user", "content": "Name a relay race leg. 🏃"},
    ]
    expected = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    request = generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(
            messages=[
                generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages
            ]
        ),
        sampling_params=common_pb2.SamplingParameters(max_tokens=1, prompt_logprobs=0),
    )
    async with gateway_stub(cluster.gateway_address) as stub:
        outcome = await generate(stub, request)
    # Every prompt token after the first comes back with its log-probability.
    echoed = [t.token_id for r in outcome.responses for t in r.prompt_logprobs]
    assert echoed == list(expected)[1:]
    assert outcome.responses[-1].usage.prompt_tokens == len(expected)
    gateway = cluster.process("gateway")
    maps = Path(f"/proc/{gateway.pid}/maps").read_text()
    assert "libtorch" not in maps


async def test_refused_fields_and_bad_values_name_the_field(cluster: E2ECluster) -> None:
    client = client_for(cluster)
    async with client:
        model = await model_id(client)
        for case_id, endpoint, body, param in REFUSED:
            sent = {**body, "model": model} if "model" in body else body
            path = "/completions" if endpoint is Endpoint.COMPLETIONS else "/chat/completions"
            with pytest.raises(openai.BadRequestError) as info:
                await client.post(path, cast_to=object, body=sent)
            assert info.value.status_code == 400, case_id
            assert info.value.body["param"] == param, (case_id, info.value.body)
            assert info.value.body["type"] == "invalid_request_error", case_id

        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="gpt-4o", prompt="hi")
        assert missing.value.body["param"] == "model"
        assert missing.value.body["code"] == "model_not_found"

        with pytest.raises(openai.BadRequestError) as too_long:
            await client.completions.create(model=model, prompt="hello " * 1100)
        assert too_long.value.body["code"] == "context_length_exceeded"
        assert too_long.value.body["param"] == "prompt"

        # The server is unharmed.
        ok = await client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert ok.usage.completion_tokens == 2


async def test_disconnect_mid_stream_frees_every_block(cluster: E2ECluster) -> None:
    decode = cluster.addresses("decode")[0]
    before = await worker_stats(decode, "decode")
    assert before.free_kv_blocks == before.total_kv_blocks == DECODE_BLOCKS, describe(before)
    client = client_for(cluster)
    async with client:
        model = await model_id(client)
        stream = await client.completions.create(
            model=model,
            prompt=prompt_ids(40, "disconnect"),
            max_tokens=900,
            stream=True,
            **GREEDY,
        )
        got = 0
        async for chunk in stream:
            assert chunk.choices[0].finish_reason is None
            got += 1
            if got == 8:
                stats = await worker_stats(decode, "decode")
                assert stats.num_running == 1, describe(stats)
                assert stats.free_kv_blocks < DECODE_BLOCKS, describe(stats)
                break
        await stream.close()  # the client goes away with ~890 tokens still to come
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
    after = await worker_stats(decode, "decode")
    assert after.free_kv_blocks == before.free_kv_blocks, describe(after)
    assert "ended by the client (cancelled)" in cluster.logs()


async def test_structured_output_and_tool_calls_across_the_split(cluster: E2ECluster) -> None:
    """The first token is sampled under the constraint on the prefill worker, the rest on
    decode; a random model writes valid JSON only because the mask forces it."""
    client = openai.AsyncOpenAI(
        base_url=f"http://{cluster.http_address}/v1", api_key="-", max_retries=0, timeout=60
    )
    (model,) = [m.id for m in (await client.models.list()).data]
    messages = [{"role": "user", "content": "Describe someone."}]

    for i, schema in enumerate(SCHEMAS):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": i}):
            got = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=120,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
                },
                **sampling,
            )
            assert got.choices[0].finish_reason == "stop", (i, got)
            validate(json.loads(got.choices[0].message.content or ""), schema)

    regex = await client.completions.create(
        model=model,
        prompt="Code:",
        max_tokens=20,
        extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"},
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].text)
    choice = await client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert choice.choices[0].message.content in ("positive", "negative")

    named = {"type": "function", "function": {"name": "get_weather"}}
    call_args = {"model": model, "messages": messages, "tools": [WEATHER], "temperature": 0}
    whole = await client.chat.completions.create(tool_choice=named, max_tokens=60, **call_args)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = await client.chat.completions.create(
        tool_choice=named, max_tokens=60, stream=True, **call_args
    )
    deltas = [tc async for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    required = await client.chat.completions.create(
        tool_choice="required", max_tokens=60, **call_args
    )
    assert [c.function.name for c in required.choices[0].message.tool_calls or []]

    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model=model,
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            },
        )
    assert bad.value.body["param"] == "response_format.json_schema.schema"

    async with gateway_stub(cluster.gateway_address) as stub:
        schema = json.dumps(SCHEMAS[0])
        params = common_pb2.SamplingParameters(max_tokens=120, temperature=0, json_schema=schema)
        request = generate_pb2.GenerateRequest(
            chat=generate_pb2.ChatMessages(
                messages=[generate_pb2.ChatMessage(role="user", content="Describe someone.")]
            ),
            sampling_params=params,
        )
        outcome = await generate(stub, request)
        text = "".join(r.text for r in outcome.responses)
        validate(json.loads(text), SCHEMAS[0])
        # baton.v1's tools: the same rendering and constraint give the same greedy call.
        function = WEATHER["function"]
        tool = generate_pb2.Tool(
            name=function["name"],
            description=function.get("description", ""),
            parameters_json=json.dumps(function["parameters"]),
        )
        request = generate_pb2.GenerateRequest(
            chat=generate_pb2.ChatMessages(
                messages=[generate_pb2.ChatMessage(role="user", content="Describe someone.")]
            ),
            sampling_params=common_pb2.SamplingParameters(max_tokens=60, temperature=0),
            tools=[tool],
            tool_choice=generate_pb2.ToolChoice(function_name="get_weather"),
        )
        last = (await generate(stub, request)).responses[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
        assert [(c.name, c.arguments) for c in last.tool_calls] == [
            ("get_weather", call.function.arguments)
        ]
        unclosed = common_pb2.SamplingParameters(regex="[0-9")
        request = generate_pb2.GenerateRequest(text="x", sampling_params=unclosed)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(request).read()
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("sampling_params.regex")

    # The services are unharmed: the same HTTP request still answers the same.
    again = await client.chat.completions.create(tool_choice=named, max_tokens=60, **call_args)
    assert again.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    await client.close()
