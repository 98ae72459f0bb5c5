"""Reading tool calls out of a chat completion's text (``gateway.tools.plan`` says how
they were asked for).

- a named function: the text is the arguments object;
- ``required``: the text is a JSON array of ``{"name", "parameters"}`` objects;
- ``auto``: Llama 3's JSON calls, as the model wrote them: one object
  ``{"name": ..., "parameters" | "arguments": {...}}``, several separated by ``;`` or
  newlines, or a JSON array of them; optionally after Llama 3.1's ``<|python_tag|>``
  or inside Hermes-style ``<tool_call>...</tool_call>`` tags that lead the reply. Every
  name must be one of the request's tools; text that is not such a call is the
  message's content.

A reply can only be calls when it starts (after whitespace) with ``{``, ``[`` or one of
``CALL_MARKERS``: ``gateway.tools.call_stream`` streams everything else as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.tools.plan import ToolChoice, ToolPlan

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
TAG_OPEN = "<tool_call>"
CALL_MARKERS = (PYTHON_TAG, TAG_OPEN)  # what may lead a reply that is calls
ARGUMENT_KEYS = ("parameters", "arguments")  # a call's arguments, by either name


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, plan: ToolPlan) -> list[ToolCall] | None:
    """The calls in ``text``, or None when it holds none (it is then plain content)."""
    if plan.choice is ToolChoice.NAMED:
        args = _loads(text)
        if not isinstance(args, dict):
            return None
        assert plan.named is not None
        return [ToolCall(new_call_id(), plan.named, json.dumps(args, ensure_ascii=False))]
    names = {t.name for t in plan.tools}
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    tagged = _TAGGED.findall(body) if body.startswith(TAG_OPEN) else None
    if tagged:
        body = "\n".join(tagged)
    items = _loads(body)
    if items is None:  # several objects: "; " (Llama 3.2) or one per line
        parts = [p for p in re.split(r";\s*|\n+", body) if p.strip()]
        items = [_loads(p) for p in parts]
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get(ARGUMENT_KEYS[0], item.get(ARGUMENT_KEYS[1], {}))
        if isinstance(args, str):  # some models write the arguments as JSON text
            args = _loads(args)
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(new_call_id(), item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
