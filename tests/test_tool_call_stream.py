"""The incremental tool-call reader (gateway.tools.call_stream), without HTTP: fed a reply
in pieces of every size, it streams content as content and calls as they form, and what
it streams reassembles into exactly what ``parse_tool_calls`` makes of the whole reply.
"""

from __future__ import annotations

import random

import pytest

from gateway.tools.call_stream import CallArguments, CallOpened, Content, Event, ToolCallStream
from gateway.tools.calls import parse_tool_calls
from gateway.tools.plan import parse_tools
from tests.test_openai_tools import TOOLS

CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}'
REPLIES = [
    CALL,
    '  {"name":"get_weather","arguments":{"city":"Nuuk","days":1.50,"tags":["a",true,null]}}',
    f"{CALL}; " + '{"name": "get_time", "parameters": {}}',  # two calls (Llama 3.2)
    f"{CALL}\n" + '{"name": "get_time", "parameters": {}}',
    '[{"name": "get_time", "parameters": {}},\n {"name": "get_weather", "parameters": '
    '{"city": "Z\\u00fcrich \\"old\\" \\ud83c\\udf89\\n", "nested": {"x": [1, -2e3]}}}]',
    '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
    '{"name": "get_time"}',  # no arguments: "{}"
    '{"name": "get_weather", "parameters": "{\\"city\\": \\"Lima\\"}"}',  # arguments as text
    '{"parameters": {"city": "Rome"}, "name": "get_weather"}',  # name last: settled at the end
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    # Text that looks like JSON but is not a call: content, whole.
    '{"city": "Rome"} is not a call.',
    '{"name": "launch_rockets", "parameters": {}}',
    "[1, 2, 3]",
    "<b>bold</b> text",
    "It is sunny in Paris.",
    "  \n",
]


def plan(choice: str | None = None):  # noqa: ANN201
    p = parse_tools({"tools": TOOLS, "tool_choice": choice})
    assert p is not None
    return p


def split(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def run(stream: ToolCallStream, pieces: list[str]) -> list[tuple[int, list[Event]]]:
    """Each piece's events, tagged with the piece's number (len(pieces): the finish)."""
    out = [(i, stream.feed(p)) for i, p in enumerate(pieces)]
    return [*out, (len(pieces), stream.finish())]


def reassemble(events: list[Event]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallOpened):
            assert e.index == len(calls) and e.id.startswith("call_")
            calls.append([e.name, ""])
        else:
            assert isinstance(e, CallArguments)
            calls[e.index][1] += e.text
    return content, [(n, a) for n, a in calls]


@pytest.mark.parametrize("reply", REPLIES)
def test_streamed_pieces_reassemble_into_the_whole_parse(reply: str) -> None:
    p = plan()
    whole = parse_tool_calls(reply, p)
    rng = random.Random(reply)
    for pieces in ([reply], list(reply), *(split(reply, rng) for _ in range(20))):
        stream = ToolCallStream(p)
        events = [e for _, es in run(stream, pieces) for e in es]
        content, calls = reassemble(events)
        if whole is None:
            assert (content, calls) == (reply, []), pieces
            assert not stream.called
        else:
            assert content == "" and stream.called
            assert calls == [(c.name, c.arguments) for c in whole], pieces


@pytest.mark.parametrize("reply", REPLIES[:6])
def test_regular_calls_open_and_stream_before_the_reply_ends(reply: str) -> None:
    stream = ToolCallStream(plan())
    per_piece = run(stream, list(reply))
    *streaming, (_, at_finish) = per_piece
    assert not any(isinstance(e, CallOpened) for e in at_finish)
    assert any(isinstance(e, CallArguments) for _, es in streaming for e in es)


def test_a_call_opens_once_its_name_is_complete_and_its_arguments_stream() -> None:
    stream = ToolCallStream(plan())
    assert stream.feed('{"name": "get_wea') == []
    (opened,) = stream.feed('ther"')
    assert isinstance(opened, CallOpened) and opened.name == "get_weather"
    assert stream.feed(', "parameters": {"ci') == [CallArguments(0, '{"ci')]
    assert stream.feed('ty":"Os') == [CallArguments(0, 'ty": "Os')]  # as json.dumps spaces it
    assert stream.feed('lo"}}') == [CallArguments(0, 'lo"}')]
    assert stream.finish() == []


def test_content_streams_from_the_first_character() -> None:
    stream = ToolCallStream(plan())
    assert stream.feed(" Sun") == [Content(" Sun")]
    assert stream.feed('ny {"name": "get_time"}') == [Content('ny {"name": "get_time"}')]
    assert stream.finish() == [] and not stream.called
    waiting = ToolCallStream(plan())
    assert waiting.feed("<|pyt") == []  # maybe Llama 3.1's marker
    assert waiting.feed("hon is great") == [Content("<|python is great")]


def test_required_arrays_stream_each_call() -> None:
    reply = (
        '[{"name": "get_time", "parameters": {}}, '
        '{"name": "get_weather", "parameters": {"city": "X"}}]'
    )
    stream = ToolCallStream(plan("required"))
    per_piece = run(stream, list(reply))
    opened = [i for i, es in per_piece for e in es if isinstance(e, CallOpened)]
    # Each opens on the character that closes its name.
    assert opened == [reply.index("get_time") + 8, reply.index("get_weather") + 11]
    assert reassemble([e for _, es in per_piece for e in es])[1] == [
        ("get_time", "{}"),
        ("get_weather", '{"city": "X"}'),
    ]
