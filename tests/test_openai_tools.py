"""Structured output and tool calling on the HTTP API: what reaches decode (the constraint
in ``SamplingParameters``, the tools in the rendered prompt), and how the output comes back
(``tool_calls``, streamed deltas, ``finish_reason``). A real gateway in front of fake
workers scripted with the model's text; parsing (gateway.tools.calls) unit-tested first.
The real model end to end is in test_e2e_structured.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.served_model import ServedModel
from gateway.tools.calls import parse_tool_calls
from gateway.tools.plan import ToolChoice, parse_tools
from tests.fake_workers import FakeDecodeWorker, Script, fake_workers
from tests.http_helpers import MODEL, ids_of, running_http

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _plan(tool_choice: Any = None) -> Any:
    plan = parse_tools({"tools": TOOLS, "tool_choice": tool_choice})
    assert plan is not None
    return plan


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        '<tool_call>\n{"name": "get_weather", "arguments": '
        '"{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    ],
    ids=["llama3-json", "python-tag", "hermes-tags", "array"],
)
def test_auto_parses_each_supported_format(text: str) -> None:
    (call,) = parse_tool_calls(text, _plan()) or []
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")


def test_auto_parses_several_calls_and_refuses_what_is_not_one() -> None:
    plan = _plan("auto")
    calls = parse_tool_calls(
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
        '{"city": "Rome"}}',
        plan,
    )
    assert [c.name for c in calls or []] == ["get_time", "get_weather"]
    assert parse_tool_calls("It is sunny in Paris.", plan) is None
    assert parse_tool_calls('{"name": "launch_rockets", "parameters": {}}', plan) is None
    assert parse_tool_calls('{"city": "Paris"}', plan) is None


def test_tool_choice_sets_the_constraint() -> None:
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    assert _plan().choice is ToolChoice.AUTO and _plan().constraint() is None
    named, path = _plan(NAMED).constraint() or (None, "")
    assert named is not None and json.loads(named.spec) == WEATHER_PARAMS
    assert path == "tools[0].function.parameters"
    required, _ = _plan("required").constraint() or (None, "")
    assert required is not None
    items = json.loads(required.spec)["items"]["anyOf"]
    assert [i["properties"]["name"]["const"] for i in items] == ["get_weather", "get_time"]
    calls = parse_tool_calls(
        '[{"name": "get_weather", "parameters": {"city": "Lima"}}]', _plan("required")
    )
    assert [c.name for c in calls or []] == ["get_weather"]


async def test_a_named_call_is_constrained_and_returned(served_smollm2: ServedModel) -> None:
    args = '{"city": "Paris", "days": 2}'
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(served_smollm2, args), chunk=2)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        got = await gw.client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=40
        )
        stream = await gw.client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, stream=True
        )
        chunks = [c async for c in stream]
    (choice,) = got.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris",
        "days": 2,
    }
    # Streamed: one call whose argument deltas reassemble into the same arguments.
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert {d.index for d in deltas} == {0} and deltas[0].id and len(deltas) > 1
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    sent = decode.requests[0]
    assert json.loads(sent.sampling_params.json_schema) == WEATHER_PARAMS
    prompt = served_smollm2.tokenizer.decode(sent.prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>system\nYou have access to the following functions" in prompt
    assert '"name": "get_weather"' in prompt and "get_time" in prompt


async def test_auto_streams_a_call_once_complete_and_plain_text_as_content(
    served_smollm2: ServedModel,
) -> None:
    call_text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    decode = FakeDecodeWorker()
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        decode.script = Script(token_ids=ids_of(served_smollm2, call_text), chunk=3)
        stream = await gw.client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, stream=True
        )
        chunks = [c async for c in stream]
        decode.script = Script(token_ids=ids_of(served_smollm2, "Sunny."), chunk=1)
        plain = await gw.client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    first, *rest = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert first.id and first.function.name == "get_weather" and rest  # arguments follow
    arguments = "".join(d.function.arguments or "" for d in [first, *rest])
    assert json.loads(arguments) == {"city": "Oslo"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not decode.requests[0].sampling_params.HasField("json_schema")
    assert plain.choices[0].message.content == "Sunny." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


STREAMED_REPLIES = [
    '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
    '{"name": "get_time", "parameters": {}};\n{"name": "get_weather", "parameters": '
    '{"city": "Lima"}}',  # two calls
    '{"city": "Rome"} is not a call.',  # looks like JSON, is not a call
    "It is sunny.",
]


@pytest.mark.parametrize("reply", STREAMED_REPLIES)
async def test_auto_and_required_streams_reassemble_into_the_whole_response(
    served_smollm2: ServedModel, reply: str
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(served_smollm2, reply), chunk=1)
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        whole = await gw.client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        stream = await gw.client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, stream=True
        )
        chunks = [c async for c in stream]
    message = whole.choices[0].message
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            if tc.id:  # a call opens with its id and whole name
                assert tc.index not in calls and tc.function.name
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
    expected = [(t.function.name, t.function.arguments) for t in message.tool_calls or []]
    assert [tuple(v) for _, v in sorted(calls.items())] == expected
    assert content == (message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    if expected:  # streamed as generated: the first call opened before the last token
        opened = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
        assert opened < len(chunks) - 3


async def test_a_tool_result_round_trips_through_the_template(
    served_smollm2: ServedModel,
) -> None:
    decode = FakeDecodeWorker()
    decode.script = Script(token_ids=ids_of(served_smollm2, "It is 18C."), chunk=4)
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        got = await gw.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert got.choices[0].message.content == "It is 18C."
    prompt = served_smollm2.tokenizer.decode(
        decode.requests[0].prompt_token_ids, skip_special_tokens=False
    )
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in prompt
    assert '<|im_start|>tool\n{"temp_c": 18}<|im_end|>' in prompt


async def test_each_constraint_field_reaches_decode(served_smollm2: ServedModel) -> None:
    decode = FakeDecodeWorker()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    async with fake_workers([decode]) as (d, _), running_http(served_smollm2, d) as gw:
        await gw.client.chat.completions.create(
            model=MODEL,
            messages=USER,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema, "strict": True},
            },
        )
        await gw.client.chat.completions.create(
            model=MODEL, messages=USER, response_format={"type": "json_object"}
        )
        await gw.client.completions.create(
            model=MODEL, prompt="x", extra_body={"guided_regex": "[0-9]+"}
        )
        await gw.client.completions.create(
            model=MODEL, prompt="x", extra_body={"structured_outputs": {"choice": ["a", "b"]}}
        )
        await gw.client.completions.create(
            model=MODEL, prompt="x", extra_body={"guided_grammar": 'start: "a"+'}
        )
    sent = [r.sampling_params for r in decode.requests]
    assert [s.WhichOneof("constraint") for s in sent] == [
        "json_schema",
        "json_object",
        "regex",
        "choice",
        "grammar",
    ]
    assert json.loads(sent[0].json_schema) == schema and sent[1].json_object
    assert sent[2].regex == "[0-9]+" and list(sent[3].choice.choices) == ["a", "b"]
