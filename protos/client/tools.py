"""Tool calling in the client: the functions a request offers the model (:class:`Tool`),
how it may use them (``tool_choice``), and the calls a reply made (:class:`ToolCall`),
mapped to and from ``baton.v1``'s ``tools``, ``tool_choice`` and ``tool_calls``.

As elsewhere in the client, values are not checked here: the gateway answers
INVALID_ARGUMENT naming the field (a bad name, a schema that is not an object, a
``tool_choice`` function that is not among the tools)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protos.baton.v1 import generate_pb2

_MODES = {
    "none": generate_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": generate_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": generate_pb2.TOOL_CHOICE_MODE_REQUIRED,
}

#: ``"none"``, ``"auto"``, ``"required"``, or the function the model must call, as
#: ``{"name": ...}`` or OpenAI's ``{"type": "function", "function": {"name": ...}}``.
ToolChoiceSpec = str | Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; ``parameters`` is the JSON schema of its arguments
    (an object; None: no arguments)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None

    def to_proto(self) -> generate_pb2.Tool:
        msg = generate_pb2.Tool(name=self.name, description=self.description)
        if self.parameters is not None:
            msg.parameters_json = json.dumps(self.parameters)
        return msg


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call a reply made: ``arguments`` is JSON text (an object), as the model wrote
    it; :meth:`parsed_arguments` decodes it."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)

    @classmethod
    def from_proto(cls, msg: generate_pb2.ToolCall) -> ToolCall:
        return cls(id=msg.id, name=msg.name, arguments=msg.arguments)

    def to_proto(self) -> generate_pb2.ToolCall:
        return generate_pb2.ToolCall(id=self.id, name=self.name, arguments=self.arguments)


def add_tools(
    msg: generate_pb2.GenerateRequest,
    tools: Sequence[Tool] | None,
    tool_choice: ToolChoiceSpec | None,
) -> None:
    """Set ``tools`` and ``tool_choice`` on ``msg`` (a request without either is left as it
    is). A ``tool_choice`` of another type is a mistake in the calling code: TypeError."""
    for tool in tools or ():
        msg.tools.append(tool.to_proto())
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in _MODES:
            raise TypeError(
                f"tool_choice must be one of {sorted(_MODES)} or a function, got {tool_choice!r}"
            )
        msg.tool_choice.mode = _MODES[tool_choice]
    elif isinstance(tool_choice, Mapping):
        function = tool_choice.get("function", tool_choice)
        if not isinstance(function, Mapping) or "name" not in function:
            raise TypeError(f"tool_choice names no function: {tool_choice!r}")
        msg.tool_choice.function_name = function["name"]
    else:
        raise TypeError(f"tool_choice must be a string or a mapping, got {tool_choice!r}")


def add_turn(messages: generate_pb2.ChatMessages, turn: Mapping[str, Any]) -> None:
    """One chat turn given as a mapping, with an assistant turn's ``tool_calls`` (
    :class:`ToolCall` or OpenAI's ``{"id", "function": {"name", "arguments"}}``) and a tool
    turn's ``tool_call_id``."""
    msg = messages.messages.add(role=turn["role"], content=turn.get("content") or "")
    for call in turn.get("tool_calls") or ():
        if isinstance(call, ToolCall):
            msg.tool_calls.append(call.to_proto())
            continue
        function = call.get("function", call)
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        msg.tool_calls.add(id=call.get("id", ""), name=function["name"], arguments=arguments)
    if turn.get("tool_call_id") is not None:
        msg.tool_call_id = turn["tool_call_id"]
