"""Tool calls read out of a reply while it streams (``tool_choice`` ``auto`` or
``required``), as vLLM's tool parsers do: what is content streams as content, a call
opens (id and name) as soon as its name is complete, and its arguments follow as they
are generated.

The formats and the final word are ``gateway.tools.calls``'s: a reply is calls exactly
when ``parse_tool_calls`` reads it as calls, and at the end every call's streamed
arguments are completed to the text that parse gives (``json.dumps`` of the arguments).
Streaming only decides early what it can:

- a reply whose first character (after whitespace) is none of ``{``, ``[``, ``<`` can
  never parse as calls (``parse_tool_calls`` needs a JSON object or array, or a leading
  marker), so it streams as content from its first character on;
- otherwise nothing is shown until a call's ``"name"`` (its first key) is complete and
  names a listed tool; the call then opens, and its ``"parameters"`` (or
  ``"arguments"``) object streams canonically: each JSON token as ``json.dumps`` writes
  it (``", "``, ``": "``, strings re-escaped as it escapes them, string contents as they
  come), so the streamed text is a prefix of ``json.dumps`` of the final arguments;
- any other shape (keys in another order, arguments as JSON text, Hermes tags) is held
  to the end and settled by ``parse_tool_calls``: the calls not yet streamed come then,
  whole, or the held text as content.

One known difference: a reply that opened a call and then stops being one (text after
the calls) has streamed that call, while the whole reply is content to
``parse_tool_calls``. The JSON of a call's arguments with a repeated key streams the
first value but parses to the last.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.tools.calls import (
    ARGUMENT_KEYS,
    CALL_MARKERS,
    PYTHON_TAG,
    ToolCall,
    new_call_id,
    parse_tool_calls,
)
from gateway.tools.plan import ToolPlan

_WS = " \t\r\n"
_NUMBER = re.compile(r"-?(?:Infinity|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)|NaN")
_LITERALS = ("true", "false", "null")
_SEPARATORS = {",": ", ", ":": ": "}


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallOpened:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallOpened | CallArguments


def stream_delta(event: Event) -> dict[str, Any]:
    """An event as an OpenAI chat chunk's ``delta``."""
    if isinstance(event, Content):
        return {"content": event.text}
    if isinstance(event, CallOpened):
        function = {"name": event.name, "arguments": ""}
        call = {"index": event.index, "id": event.id, "type": "function", "function": function}
        return {"tool_calls": [call]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


class _Incomplete(Exception):
    """The text so far ends inside the token being read; wait for more."""


class _Irregular(Exception):
    """Not the shape streamed early; the rest is held and settled at the end."""


@dataclass(slots=True)
class _Open:
    """A call streamed so far."""

    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolCallStream:
    """One choice's reply, fed as it is generated. ``feed`` returns the events the text
    so far settles; ``finish`` the rest, once the reply is complete."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._names = {t.name for t in plan.tools}
        self._text = ""
        self._mode = "undecided"  # -> content | calls | held
        self._pos = 0  # calls: text before this is settled
        self._array = False  # calls: the calls are a JSON array's items
        self._calls: list[_Open] = []
        self._args: _ArgsWriter | None = None  # the open call's arguments, mid-stream
        self._closing = False  # calls: the open call's object is still to close
        self._named = False  # calls: the open call's name was read, its arguments not yet
        self._ended = False  # calls: the array closed

    @property
    def called(self) -> bool:
        """Whether a call was streamed (the choice then finishes with ``tool_calls``)."""
        return bool(self._calls)

    def feed(self, text: str) -> list[Event]:
        self._text += text
        if self._mode == "content":
            return [Content(text)] if text else []
        if self._mode == "undecided":
            head = self._text.lstrip(_WS)
            if not head or any(m.startswith(head) and m != head for m in CALL_MARKERS):
                return []  # nothing yet, or maybe a marker: wait
            if head.startswith(PYTHON_TAG):  # Llama 3.1: the calls follow the tag
                self._mode = "calls"
                self._pos = len(self._text) - len(head) + len(PYTHON_TAG)
            elif head[0] in "{[":
                self._mode = "calls"
                self._pos = len(self._text) - len(head)
            elif head.startswith(CALL_MARKERS):
                self._mode = "held"
                return []
            else:
                self._mode = "content"
                return [Content(self._text)]
        if self._mode == "calls":
            return self._advance(final=False)
        return []

    def finish(self) -> list[Event]:
        """The events that settle the complete reply."""
        if self._mode == "content":
            return []
        out = self._advance(final=True) if self._mode == "calls" else []
        calls = parse_tool_calls(self._text, self._plan)
        if calls is None:
            if not self._calls and self._text:
                out.append(Content(self._text))
            return out
        return out + self._complete(calls)

    # -- calls --------------------------------------------------------------------------

    def _complete(self, calls: list[ToolCall]) -> list[Event]:
        out: list[Event] = []
        for i, call in enumerate(calls):
            if i >= len(self._calls):
                self._calls.append(_Open(call.id, call.name))
                out.append(CallOpened(i, call.id, call.name))
            sent = "".join(self._calls[i].arguments)
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                rest = call.arguments[len(sent) :]
                self._calls[i].arguments.append(rest)
                out.append(CallArguments(i, rest))
        return out

    def _advance(self, *, final: bool) -> list[Event]:
        out: list[Event] = []
        try:
            while True:
                if self._args is not None:
                    self._pos, text, done = self._args.advance(self._text, self._pos, final)
                    if text:
                        self._calls[-1].arguments.append(text)
                        out.append(CallArguments(len(self._calls) - 1, text))
                    if not done:
                        return out
                    self._args, self._closing = None, True
                if self._named:
                    self._arguments()
                    continue
                if self._closing:
                    self._pos = _expect(self._text, self._pos, "}")
                    self._closing = False
                    continue
                if not self._next_call(out):
                    return out
        except _Incomplete:
            return out
        except _Irregular:
            self._mode = "held"
            return out

    def _next_call(self, out: list[Event]) -> bool:
        """Read up to the next call's name and open it; False once the calls end."""
        text, pos = self._text, _skip(self._text, self._pos)
        if pos == len(text):
            raise _Incomplete
        if self._ended:
            raise _Irregular  # text after the array
        if not self._calls and not self._array and text[pos] == "[":
            self._array, self._pos = True, pos + 1
            pos = _skip(text, pos + 1)
            if pos == len(text):
                raise _Incomplete
        elif self._calls:  # a separator between calls
            if self._array and text[pos] == "]":
                self._ended, self._pos = True, pos + 1
                return False
            sep = "," if self._array else ";"
            if text[pos] == sep:
                pos = _skip(text, pos + 1)
            elif self._array or "\n" not in text[self._pos : pos]:
                raise _Irregular
        pos = _expect(text, pos, "{")
        key, pos = _string(text, _skip(text, pos))
        if key != "name":
            raise _Irregular
        pos = _expect(text, _skip(text, pos), ":")
        name, pos = _string(text, _skip(text, pos))
        if name not in self._names:
            raise _Irregular
        self._open(out, name)
        self._pos, self._named = pos, True
        return True

    def _arguments(self) -> None:
        """After an open call's name: up to its arguments object, or the call's end."""
        text, pos = self._text, _skip(self._text, self._pos)
        if pos == len(text):
            raise _Incomplete
        if text[pos] == "}":  # no arguments: settled at the end as "{}"
            self._pos, self._named = pos + 1, False
            return
        pos = _expect(text, pos, ",")
        key, pos = _string(text, _skip(text, pos))
        if key not in ARGUMENT_KEYS:
            raise _Irregular
        pos = _expect(text, _skip(text, pos), ":")
        pos = _skip(text, pos)
        if pos == len(text):
            raise _Incomplete
        if text[pos] != "{":
            raise _Irregular  # arguments as JSON text: settled at the end
        self._args, self._named = _ArgsWriter(), False
        self._pos = pos

    def _open(self, out: list[Event], name: str) -> None:
        call = _Open(new_call_id(), name)
        self._calls.append(call)
        out.append(CallOpened(len(self._calls) - 1, call.id, name))


class _ArgsWriter:
    """An arguments object, lexed as it arrives and written as ``json.dumps`` would."""

    def __init__(self) -> None:
        self._depth = 0
        self._string_sent = -1  # in a string: raw characters of it already written

    def advance(self, text: str, pos: int, final: bool) -> tuple[int, str, bool]:
        """From ``pos``: (where it stopped, the canonical text read, whether the object
        closed)."""
        out: list[str] = []
        while True:
            if self._string_sent >= 0:
                pos, done = self._string(text, pos, out)
                if not done:
                    return pos, "".join(out), False
                continue
            pos = _skip(text, pos)
            if pos == len(text):
                return pos, "".join(out), False
            ch = text[pos]
            if ch in "{[":
                self._depth += 1
                out.append(ch)
                pos += 1
            elif ch in "}]":
                if self._depth == 1:
                    if ch != "}":
                        raise _Irregular
                    out.append("}")
                    self._depth = 0
                    return pos + 1, "".join(out), True
                self._depth -= 1
                out.append(ch)
                pos += 1
            elif ch in _SEPARATORS:
                out.append(_SEPARATORS[ch])
                pos += 1
            elif ch == '"':
                out.append('"')
                self._string_sent = 0
                pos += 1
            else:
                try:
                    token, pos = _scalar(text, pos, final)
                except _Incomplete:
                    return pos, "".join(out), False
                out.append(token)

    def _string(self, text: str, pos: int, out: list[str]) -> tuple[int, bool]:
        """Inside a string whose opening quote is before ``pos``: write what is settled."""
        i = pos
        while i < len(text):
            ch = text[i]
            if ch == '"':
                out.append(_reescape(text[pos:i]) + '"')
                self._string_sent = -1
                return i + 1, True
            if ch == "\\":
                end = _escape_end(text, i)
                if end is None:
                    break
                i = end
            else:
                i += 1
        if i > pos:
            out.append(_reescape(text[pos:i]))
        return i, False


def _reescape(raw: str) -> str:
    """Raw JSON string content (complete escapes only) as ``json.dumps`` writes it."""
    try:
        value = json.loads('"' + raw + '"')
    except json.JSONDecodeError as exc:
        raise _Irregular from exc
    return json.dumps(value, ensure_ascii=False)[1:-1]


def _escape_end(text: str, i: int) -> int | None:
    """The end of the escape at ``text[i]`` (a backslash), None while incomplete; a high
    surrogate waits for its low half, so a pair is never split."""
    if i + 1 >= len(text):
        return None
    if text[i + 1] != "u":
        return i + 2
    if i + 6 > len(text):
        return None
    code = text[i + 2 : i + 6]
    if not re.fullmatch(r"[0-9a-fA-F]{4}", code):
        raise _Irregular
    if 0xD800 <= int(code, 16) <= 0xDBFF:
        if i + 12 > len(text):
            return None
        if text[i + 6 : i + 8] == "\\u":
            return i + 12
    return i + 6


def _scalar(text: str, pos: int, final: bool) -> tuple[str, int]:
    """A number or literal at ``pos`` (complete once a delimiter follows it, or the text
    is final), as ``json.dumps`` writes it."""
    end = pos
    while end < len(text) and text[end] not in _WS + ',:}]{["':
        end += 1
    if end == len(text) and not final:
        raise _Incomplete
    token = text[pos:end]
    if token in _LITERALS:
        return token, end
    if not _NUMBER.fullmatch(token):
        raise _Irregular
    return json.dumps(json.loads(token)), end


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _expect(text: str, pos: int, ch: str) -> int:
    pos = _skip(text, pos)
    if pos == len(text):
        raise _Incomplete
    if text[pos] != ch:
        raise _Irregular
    return pos + 1


def _string(text: str, pos: int) -> tuple[str, int]:
    """A complete JSON string at ``pos``, decoded."""
    if pos == len(text):
        raise _Incomplete
    if text[pos] != '"':
        raise _Irregular
    i = pos + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            try:
                return json.loads(text[pos : i + 1]), i + 1
            except json.JSONDecodeError as exc:
                raise _Irregular from exc
        else:
            i += 1
    raise _Incomplete
