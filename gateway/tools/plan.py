"""Tool calling on ``/v1/chat/completions``: the ``tools`` and ``tool_choice`` fields, how
the tools reach the prompt, and the constraint a forced call is generated under.

Format: Llama 3's JSON tool calling (what SmolLM2 and Llama 3.x instruct models are
prompted with): the tools are described in a system message, and a call is the JSON
object ``{"name": <function>, "parameters": {<arguments>}}``. The tool list goes into the
first system message (or a new one), rendered by the model's chat template like any
other message; an assistant message's ``tool_calls`` are rendered as those JSON objects,
one per line, and a ``tool`` message as a ``tool`` turn.

``tool_choice``:
- ``none``: the tools are not shown and no call is parsed;
- ``auto`` (the default with tools): free generation; ``gateway.tools.calls`` parses the
  output as calls when it is one (else it is the message's content);
- ``required``: generated under a JSON schema for a non-empty array of calls, each an
  object naming one of the tools with arguments valid under that tool's parameters;
- a named function (``{"type": "function", "function": {"name": ...}}``): only the
  arguments are generated, under the function's parameters schema.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.constraint import Constraint
from gateway.validation import FieldError, schema_constraint
from gateway.validation import json_kind as _kind

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOLS_PROMPT = (
    "You have access to the following functions. To call a function, respond with JSON "
    'of the form {"name": function name, "parameters": dictionary of argument name and '
    "its value}. Do not use variables. Otherwise answer in plain text.\n\n"
)


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]

    def as_json(self) -> str:
        function = {"name": self.name, "description": self.description}
        function["parameters"] = self.parameters  # type: ignore[assignment]
        return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools and what ``tool_choice`` makes of them."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    named: str | None = None  # the function, when choice is NAMED

    def constraint(
        self, parameters_field: str = "function.parameters"
    ) -> tuple[Constraint, str] | None:
        """What the output is generated under, and the field its schema came from (None:
        free text). ``parameters_field``: where a tool's schema sits under ``tools[i]``
        (the HTTP body's spelling by default; baton.v1 names its own)."""
        if self.choice is ToolChoice.NAMED:
            tool = next(t for t in self.tools if t.name == self.named)
            path = f"tools[{self.tools.index(tool)}].{parameters_field}"
            return schema_constraint(tool.parameters, path), path
        if self.choice is ToolChoice.REQUIRED:
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            return schema_constraint(schema, "tools"), "tools"
        return None

    def system_text(self) -> str:
        return TOOLS_PROMPT + "\n\n".join(t.as_json() for t in self.tools)


def parse_tools(b: Mapping[str, Any]) -> ToolPlan | None:
    """The body's ``tools`` and ``tool_choice``; None when no tool may be called."""
    raw = b.get("tools", [])
    if not isinstance(raw, list):
        raise FieldError("tools", f"tools must be a list, got {_kind(raw)}")
    if len(raw) > MAX_TOOLS:
        raise FieldError("tools", f"tools has {len(raw)} entries; at most {MAX_TOOLS} allowed")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    choice, named = _tool_choice(b.get("tool_choice"), bool(tools))
    return checked_plan(tools, choice, named, "function.name", "tool_choice.function.name")


def checked_plan(
    tools: tuple[Tool, ...],
    choice: ToolChoice,
    named: str | None,
    name_field: str,
    named_field: str,
) -> ToolPlan | None:
    """The plan, once the names are unique and a named function is among them (errors
    name ``tools[i].<name_field>`` and ``named_field``, each surface's own spelling);
    None when no tool may be called."""
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            field = f"tools[{i}].{name_field}"
            raise FieldError(field, f"{field} {name!r} is listed twice")
    if named is not None and named not in names:
        raise FieldError(named_field, f"{named_field} is {named!r}, which tools does not list")
    if not tools or choice is ToolChoice.NONE:
        return None
    return ToolPlan(tools, choice, named)


def _tool(value: object, path: str) -> Tool:
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise FieldError(
            f"{path}.type", f"{path}.type must be 'function' (with a 'function' object)"
        )
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise FieldError(f"{path}.function", f"{path}.function must be an object")
    for key in function:
        if key not in ("name", "description", "parameters", "strict"):
            raise FieldError(f"{path}.function.{key}", f"{path}.function.{key} is not supported")
    name = check_tool_name(function.get("name"), f"{path}.function.name")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise FieldError(
            f"{path}.function.description", f"{path}.function.description must be a string"
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, Mapping):
        raise FieldError(
            f"{path}.function.parameters",
            f"{path}.function.parameters must be a JSON schema object",
        )
    return Tool(name, description, parameters)


def check_tool_name(name: object, field: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise FieldError(field, f"{field} must be 1-64 letters, digits, '_' or '-', got {name!r}")
    return name


def _tool_choice(value: object, has_tools: bool) -> tuple[ToolChoice, str | None]:
    if value is None:
        return (ToolChoice.AUTO if has_tools else ToolChoice.NONE), None
    if isinstance(value, str):
        try:
            choice = ToolChoice(value)
        except ValueError:
            choice = None
        if choice is None or choice is ToolChoice.NAMED:
            raise FieldError(
                "tool_choice",
                f"tool_choice must be none, auto, required or a named function, got {value!r}",
            )
        if choice is not ToolChoice.NONE and not has_tools:
            raise FieldError("tool_choice", f"tool_choice={value!r} needs tools")
        return choice, None
    if isinstance(value, Mapping) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise FieldError("tool_choice.function.name", "tool_choice.function.name is required")
        return ToolChoice.NAMED, name
    raise FieldError(
        "tool_choice", f"tool_choice must be a string or a named function, got {_kind(value)}"
    )


def assistant_calls_text(calls: object, path: str) -> str:
    """An assistant message's ``tool_calls`` as the model writes calls (one per line)."""
    if not isinstance(calls, list) or not calls:
        raise FieldError(path, f"{path} must be a non-empty list of tool calls")
    lines = []
    for i, call in enumerate(calls):
        here = f"{path}[{i}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise FieldError(f"{here}.function", f"{here}.function must name the function")
        arguments = function.get("arguments", "{}")
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as exc:
            raise FieldError(
                f"{here}.function.arguments", f"{here}.function.arguments is not JSON: {exc}"
            ) from exc
        lines.append(json.dumps({"name": function["name"], "parameters": args}))
    return "\n".join(lines)


def with_tools_prompt(
    pairs: Sequence[tuple[str, str]], plan: ToolPlan | None
) -> list[tuple[str, str]]:
    """(role, content) turns with the tools described in the first system message."""
    turns = list(pairs)
    if plan is None:
        return turns
    if turns and turns[0][0] == "system":
        turns[0] = ("system", turns[0][1] + "\n\n" + plan.system_text())
    else:
        turns.insert(0, ("system", plan.system_text()))
    return turns
