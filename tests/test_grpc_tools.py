"""Tool calling on ``baton.v1`` Generate: a real gateway server in front of fake workers
scripted with the model's text. The tools reach the prompt as on HTTP, a forced call is
constrained, a reply that parses as calls ends with ``tool_calls`` and
FINISH_REASON_TOOL_CALLS, and bad tools are INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.served_model import ServedModel
from protos.baton.v1 import common_pb2, generate_pb2
from tests.fake_workers import FakeDecodeWorker, Script, fake_workers
from tests.test_gateway_service import generate, generate_error, ids_of, running_gateway

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    generate_pb2.Tool(
        name="get_weather", description="Weather in a city", parameters_json=json.dumps(WEATHER)
    ),
    generate_pb2.Tool(name="get_time", description="The time now"),
]
USER = generate_pb2.ChatMessages(
    messages=[generate_pb2.ChatMessage(role="user", content="Weather in Paris?")]
)


@pytest.fixture(name="model")
def _model(served_smollm2: ServedModel) -> ServedModel:
    return served_smollm2


def tool_request(
    choice: generate_pb2.ToolChoice | None = None, **fields: object
) -> generate_pb2.GenerateRequest:
    fields.setdefault("chat", USER)
    return generate_pb2.GenerateRequest(tools=TOOLS, tool_choice=choice, **fields)


def prompt_of(model: ServedModel, decode: FakeDecodeWorker) -> str:
    return model.tokenizer.decode(decode.requests[-1].prompt_token_ids, skip_special_tokens=False)


async def test_a_named_call_is_constrained_and_ends_with_its_call(model: ServedModel) -> None:
    args = '{"city": "Paris", "days": 2}'
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(model, args), chunk=2)
    named = generate_pb2.ToolChoice(function_name="get_weather")
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, tool_request(named))
    assert "".join(r.text for r in got) == args  # the reply streams as it is generated
    assert all(not r.tool_calls for r in got[:-1])
    (call,) = got[-1].tool_calls
    assert call.id.startswith("call_") and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    sent = decode.requests[0].sampling_params
    assert json.loads(sent.json_schema) == WEATHER
    prompt = prompt_of(model, decode)
    assert "<|im_start|>system\nYou have access to the following functions" in prompt
    assert '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt


async def test_required_is_generated_under_the_calls_schema(model: ServedModel) -> None:
    reply = (
        '[{"name": "get_time", "parameters": {}}, '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    )
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(model, reply), chunk=5)
    required = generate_pb2.ToolChoice(mode=generate_pb2.TOOL_CHOICE_MODE_REQUIRED)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, tool_request(required))
    assert [(c.name, json.loads(c.arguments)) for c in got[-1].tool_calls] == [
        ("get_time", {}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    schema = json.loads(decode.requests[0].sampling_params.json_schema)
    assert schema["minItems"] == 1
    assert [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == [
        "get_weather",
        "get_time",
    ]


async def test_auto_parses_a_call_and_leaves_text_as_text(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        decode.script = Script(
            token_ids=ids_of(model, '{"name": "get_weather", "parameters": {"city": "Rome"}}')
        )
        call = await generate(gw.stub, tool_request())
        decode.script = Script(token_ids=ids_of(model, '{"city": "Rome"} is not a call.'))
        text = await generate(gw.stub, tool_request())
        none = generate_pb2.ToolChoice(mode=generate_pb2.TOOL_CHOICE_MODE_NONE)
        decode.script = Script(token_ids=ids_of(model, '{"name": "get_time", "parameters": {}}'))
        off = await generate(gw.stub, tool_request(none))
    assert not decode.requests[0].sampling_params.HasField("json_schema")
    (c,) = call[-1].tool_calls
    assert (c.name, json.loads(c.arguments)) == ("get_weather", {"city": "Rome"})
    assert not text[-1].tool_calls and text[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    # tool_choice none: the tools are not shown and nothing is parsed.
    assert not off[-1].tool_calls and off[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert "You have access" not in prompt_of(model, decode)


async def test_each_choice_ends_with_its_own_calls(model: ServedModel) -> None:
    texts = ['{"name": "get_time", "parameters": {}}', "No call here."]
    decode = FakeDecodeWorker()
    decode.script = Script(choice_token_ids=[ids_of(model, t) for t in texts])
    params = common_pb2.SamplingParameters(n=2, temperature=1.0, seed=3)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, tool_request(sampling_params=params))
    ends = {r.index: r for r in got if r.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED}
    assert [c.name for c in ends[0].tool_calls] == ["get_time"]
    assert ends[0].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert not ends[1].tool_calls and ends[1].finish_reason == common_pb2.FINISH_REASON_STOP


async def test_an_assistant_call_and_its_result_round_trip(model: ServedModel) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(model, "It is 18C."))
    chat = generate_pb2.ChatMessages(
        messages=[
            *USER.messages,
            generate_pb2.ChatMessage(
                role="assistant",
                tool_calls=[
                    generate_pb2.ToolCall(
                        id="call_1", name="get_weather", arguments='{"city": "Paris"}'
                    )
                ],
            ),
            generate_pb2.ChatMessage(role="tool", content='{"temp_c": 18}', tool_call_id="call_1"),
        ]
    )
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got = await generate(gw.stub, tool_request(chat=chat))
    assert "".join(r.text for r in got) == "It is 18C." and not got[-1].tool_calls
    prompt = prompt_of(model, decode)
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in prompt
    assert '<|im_start|>tool\n{"temp_c": 18}<|im_end|>' in prompt


BAD = [
    (
        tool_request(),
        "tools[1].name",
        {"tools": [TOOLS[0], generate_pb2.Tool(name="bad name")]},
    ),
    (tool_request(), "tools[1].name", {"tools": [TOOLS[0], TOOLS[0]]}),
    (
        tool_request(),
        "tools[0].parameters_json",
        {"tools": [generate_pb2.Tool(name="f", parameters_json="{not json")]},
    ),
    (
        tool_request(),
        "tools[0].parameters_json",
        {"tools": [generate_pb2.Tool(name="f", parameters_json="[1]")]},
    ),
    (
        tool_request(generate_pb2.ToolChoice(function_name="launch")),
        "tool_choice.function_name",
        {},
    ),
    (
        tool_request(generate_pb2.ToolChoice(function_name="f")),
        "tools[0].parameters_json",
        {"tools": [generate_pb2.Tool(name="f", parameters_json='{"type": "nonsense"}')]},
    ),
    (
        generate_pb2.GenerateRequest(
            chat=USER, tool_choice=generate_pb2.ToolChoice(mode=generate_pb2.TOOL_CHOICE_MODE_AUTO)
        ),
        "tool_choice.mode",
        {},
    ),
    (generate_pb2.GenerateRequest(text="hi", tools=TOOLS), "tools", {}),
    (
        tool_request(
            generate_pb2.ToolChoice(mode=generate_pb2.TOOL_CHOICE_MODE_REQUIRED),
            sampling_params=common_pb2.SamplingParameters(regex="[a-z]+"),
        ),
        "sampling_params.regex",
        {},
    ),
]


@pytest.mark.parametrize(("request_", "field", "change"), BAD)
async def test_bad_tools_are_invalid_argument_naming_the_field(
    model: ServedModel, request_: generate_pb2.GenerateRequest, field: str, change: dict
) -> None:
    bad = generate_pb2.GenerateRequest()
    bad.CopyFrom(request_)
    for name, value in change.items():
        bad.ClearField(name)  # type: ignore[arg-type]
        getattr(bad, name).extend(value)
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        got, error = await generate_error(gw.stub, bad)
        ok = await generate(gw.stub, tool_request())
    assert not got and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(field), error.details()
    assert len(decode.requests) == 1 and ok[-1].finish_reason  # nothing queued; still serving


async def test_the_python_client_sends_tools_and_reads_the_calls(model: ServedModel) -> None:
    """``protos.client``: ``tools`` and ``tool_choice`` reach the gateway as the proto's, a
    call comes back as a ToolCall on the completion, and an assistant turn's calls and a
    tool turn's id (OpenAI's shapes) round-trip through the chat."""
    from protos.client import AsyncClient, FinishReason, Tool, ToolCall

    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(model, '{"city": "Oslo"}'))
    weather = Tool("get_weather", "Weather in a city", WEATHER)
    async with fake_workers([decode]) as (d, _), running_gateway(model, d) as gw:
        async with AsyncClient(f"127.0.0.1:{gw.server.port}") as client:
            done = await client.complete(
                chat=[("user", "Weather in Oslo?")],
                tools=[weather, Tool("get_time")],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
            sent = decode.requests[-1]
            decode.script = Script(token_ids=ids_of(model, "It is 3C."))
            chat = [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "tool_calls": list(done.tool_calls)},
                {"role": "tool", "content": '{"temp_c": 3}', "tool_call_id": done.tool_calls[0].id},
            ]
            reply = await client.complete(chat=chat, tools=[weather], tool_choice="auto")
    assert sent.sampling_params.HasField("json_schema")  # the named call is constrained
    assert done.finish_reason is FinishReason.TOOL_CALLS
    (call,) = done.tool_calls
    assert isinstance(call, ToolCall) and call.name == "get_weather"
    assert call.parsed_arguments() == {"city": "Oslo"} and call.id.startswith("call_")
    assert reply.text == "It is 3C." and not reply.tool_calls
    prompt = prompt_of(model, decode)
    assert (
        '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Oslo"}}' in prompt
    )
    assert '<|im_start|>tool\n{"temp_c": 3}<|im_end|>' in prompt
