"""Tool calling on ``baton.v1`` Generate: the request's ``tools`` and ``tool_choice``
checked at the edge, rendered into the chat and turned into the reply's constraint, and
each choice's reply read back as calls.

Everything but the proto field names is the HTTP path's: the tools prompt and the chat's
assistant calls are rendered by ``gateway.tools.plan`` (through the model's chat
template, like any turn), ``required`` and a named function are generated under the JSON
schema ``ToolPlan.constraint`` builds, and replies are parsed by ``gateway.tools.calls``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from gateway.grpc_api.request import validate_generate_request
from gateway.text.output_processor import GenerateDelta
from gateway.tools.calls import ToolCall, parse_tool_calls
from gateway.tools.plan import (
    MAX_TOOLS,
    Tool,
    ToolChoice,
    ToolPlan,
    assistant_calls_text,
    check_tool_name,
    checked_plan,
    with_tools_prompt,
)
from gateway.validation import (
    FieldError,
    GenerateInput,
    check_chat,
    check_constraint_compiles,
    max_prompt_chars,
)
from protos.baton.v1 import generate_pb2

if TYPE_CHECKING:
    from gateway.served_model import ModelCard

_MODES = {
    generate_pb2.TOOL_CHOICE_MODE_NONE: ToolChoice.NONE,
    generate_pb2.TOOL_CHOICE_MODE_AUTO: ToolChoice.AUTO,
    generate_pb2.TOOL_CHOICE_MODE_REQUIRED: ToolChoice.REQUIRED,
}
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def validate_tool_request(
    msg: generate_pb2.GenerateRequest, card: ModelCard
) -> tuple[GenerateInput, ToolPlan | None]:
    """``validate_generate_request`` plus the tools: the checked input (tools in its chat,
    the reply's constraint in its params) and the plan its replies are parsed with (None:
    no call can be made)."""
    plan = tool_plan_from_proto(msg)
    chat = msg.WhichOneof("prompt") == "chat"
    has_calls = chat and any(m.tool_calls for m in msg.chat.messages)
    if plan is None and not has_calls:
        return validate_generate_request(msg, card), None
    if not chat:
        raise FieldError("tools", "tools need a chat prompt (the chat template shows them)")
    rendered = generate_pb2.GenerateRequest()
    rendered.CopyFrom(msg)
    for i, m in enumerate(rendered.chat.messages):
        if m.tool_calls:
            m.content = _calls_text(m, f"chat.messages[{i}]")
            del m.tool_calls[:]
    inp = validate_generate_request(rendered, card)
    if plan is None:
        return inp, None
    assert inp.chat is not None
    pairs = [(t.role, t.content) for t in inp.chat]
    turns = check_chat(with_tools_prompt(pairs, plan), max_prompt_chars(card), "chat.messages")
    params = inp.params
    forced = plan.constraint("parameters_json")
    if forced is not None:
        if params.constraint is not None:
            raise FieldError(
                f"sampling_params.{params.constraint.field}",
                f"sampling_params.{params.constraint.field} cannot constrain a reply that "
                "must call a tool (tool_choice is required or a named function)",
            )
        constraint, field = forced
        check_constraint_compiles(constraint, lambda _: field)
        params = dataclasses.replace(params, constraint=constraint)
    return dataclasses.replace(inp, chat=turns, params=params), plan


def tool_plan_from_proto(msg: generate_pb2.GenerateRequest) -> ToolPlan | None:
    """The request's tools and tool choice; None when no tool may be called."""
    if len(msg.tools) > MAX_TOOLS:
        raise FieldError(
            "tools", f"tools has {len(msg.tools)} entries; at most {MAX_TOOLS} allowed"
        )
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(msg.tools))
    choice, named = _choice(msg, bool(tools))
    return checked_plan(tools, choice, named, "name", "tool_choice.function_name")


def _tool(t: generate_pb2.Tool, path: str) -> Tool:
    name = check_tool_name(t.name, f"{path}.name")
    parameters: Any = _EMPTY_PARAMETERS
    if t.HasField("parameters_json"):
        field = f"{path}.parameters_json"
        parameters = _json(t.parameters_json, field)
        if not isinstance(parameters, dict):
            raise FieldError(field, f"{field} must be a JSON schema object")
    return Tool(name, t.description, parameters)


def _choice(msg: generate_pb2.GenerateRequest, has_tools: bool) -> tuple[ToolChoice, str | None]:
    which = msg.tool_choice.WhichOneof("choice") if msg.HasField("tool_choice") else None
    if which == "function_name":
        name = check_tool_name(msg.tool_choice.function_name, "tool_choice.function_name")
        return ToolChoice.NAMED, name
    mode = msg.tool_choice.mode if which == "mode" else generate_pb2.TOOL_CHOICE_MODE_UNSPECIFIED
    if mode == generate_pb2.TOOL_CHOICE_MODE_UNSPECIFIED:
        return (ToolChoice.AUTO if has_tools else ToolChoice.NONE), None
    if mode not in _MODES:
        raise FieldError("tool_choice.mode", f"tool_choice.mode {mode} is not a ToolChoiceMode")
    choice = _MODES[mode]
    if choice is not ToolChoice.NONE and not has_tools:
        raise FieldError("tool_choice.mode", f"tool_choice.mode {choice.value} needs tools")
    return choice, None


def _calls_text(m: generate_pb2.ChatMessage, path: str) -> str:
    """An assistant turn's calls as the model writes them (gateway.tools.plan)."""
    if m.role != "assistant":
        raise FieldError(f"{path}.tool_calls", f"{path}.tool_calls is only for assistant turns")
    calls = []
    for j, call in enumerate(m.tool_calls):
        here = f"{path}.tool_calls[{j}]"
        check_tool_name(call.name, f"{here}.name")
        arguments = _json(call.arguments or "{}", f"{here}.arguments")
        calls.append({"function": {"name": call.name, "arguments": arguments}})
    return assistant_calls_text(calls, f"{path}.tool_calls")


def _json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise FieldError(field, f"{field} is not JSON: {exc}") from exc


class ReplyCalls:
    """Each choice's reply text, kept until the choice finishes, then read as calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._text: dict[int, list[str]] = {}

    def add(self, delta: GenerateDelta) -> list[ToolCall] | None:
        """The calls of ``delta``'s choice when this delta finishes it and its reply parses
        as calls; else None."""
        parts = self._text.setdefault(delta.index, [])
        parts.append(delta.text)
        if not delta.finished:
            return None
        return parse_tool_calls("".join(self._text.pop(delta.index)), self._plan)


def tool_call_to_proto(call: ToolCall) -> generate_pb2.ToolCall:
    return generate_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
