"""OpenAI request bodies -> the gateway's validated :class:`GenerateInput`.

``/v1/completions`` and ``/v1/chat/completions`` bodies (already JSON-decoded) are mapped
field by field onto baton's sampling parameters, and checked by the same rules as a gRPC
request (gateway.validation), under OpenAI's field names. Every failure is a
:class:`FieldError` naming the field, which the HTTP front end returns as a 400 with that
field as the error's ``param``.

Nothing is silently ignored: a field that would change the output and that baton cannot
honour (``best_of > 1``, ``suffix``, ...) is refused, and so is a field OpenAI does not
define (beyond vLLM's sampling and structured-output extras, which baton supports). A
field set to ``null``, or to the value that means "off" (``best_of: 1``, ``tools: []``),
is accepted. ``response_format`` and vLLM's constraint fields become one ``Constraint``
(gateway.http.constraint).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from gateway.http.constraint import CONSTRAINT_FIELDS, request_constraint
from gateway.http.prompt_only import DOWNSTREAM_MAX_TOKENS
from gateway.served_model import ModelCard
from gateway.tools.plan import (
    ToolPlan,
    assistant_calls_text,
    parse_tools,
    with_tools_prompt,
)
from gateway.validation import (
    FieldError,
    GenerateInput,
    check_chat,
    check_chat_template,
    check_request_id,
    check_sampling_params,
    check_stop_strings,
    check_text,
    check_token_ids,
    max_prompt_chars,
)
from gateway.validation import json_kind as _kind

# OpenAI's default for /v1/completions; chat has none (the context limit).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
REQUEST_ID_HEADER = "X-Request-Id"

# Body field -> SamplingParams field, where the two mean the same (the vLLM extras too).
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "n": "n",
}
_BOOL_FIELDS = (
    "stream",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "echo",
)
# Fields OpenAI defines that baton supports only in their "off" value.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "store": (False,),
}
# Accepted because they never change the output.
_INFORMATIONAL = ("user", "parallel_tool_calls")
_COMMON = (
    "model",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "stream_options",
    "logprobs",
    "logit_bias",
    *_SAMPLING_FIELDS,
    *_BOOL_FIELDS,
    *_INFORMATIONAL,
    *CONSTRAINT_FIELDS,
)
_COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "n", "best_of", "echo", "suffix"))
_CHAT_FIELDS = frozenset(
    (
        *_COMMON,
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        *(name for name in _OFF_VALUES if name not in ("best_of", "suffix")),
    )
)
# Fields OpenAI defines for chat that baton does not support at all; named as such in the
# error, rather than as unknown.
_KNOWN_UNSUPPORTED = frozenset(
    (
        "audio",
        "metadata",
        "prediction",
        "reasoning_effort",
        "service_tier",
        "web_search_options",
        "verbosity",
        "prompt_cache_key",
        "safety_identifier",
    )
)
_MESSAGE_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
# Message keys beyond role and content, by role (tool calling: gateway.tools.plan).
_MESSAGE_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat.completions"


class ModelNotFoundError(FieldError):
    """The body names a model this gateway does not serve (HTTP 404)."""


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A validated OpenAI request: what to generate, and how to shape the response."""

    endpoint: Endpoint
    model: str
    input: GenerateInput
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool  # whether choices carry log-probabilities (top-n in input.params)
    tools: ToolPlan | None = None  # chat: the tools the model may call, and how
    # Completions only: the response starts with the prompt (and, with logprobs, the
    # prompt tokens' logprobs: input.params.prompt_logprobs).
    echo: bool = False
    # Completions, echo with max_tokens 0: the prompt and its logprobs only; downstream
    # the request generates one token, which gateway.http.prompt_only keeps from the client.
    prompt_only: bool = False


def parse_request(
    endpoint: Endpoint, body: object, card: ModelCard, request_id: str | None
) -> OpenAIRequest:
    """Check ``body`` against the served model; raises FieldError naming the bad field.

    ``request_id`` comes from the ``X-Request-Id`` header (None: the gateway makes one).
    """
    if not isinstance(body, Mapping):
        raise FieldError("", f"the request body must be a JSON object, got {_kind(body)}")
    b = {k: v for k, v in body.items() if v is not None}  # null means "not set"
    allowed = _COMPLETION_FIELDS if endpoint is Endpoint.COMPLETIONS else _CHAT_FIELDS
    for name in b:
        if name not in allowed:
            if name in _KNOWN_UNSUPPORTED:
                raise FieldError(name, f"{name} is not supported by this server")
            raise FieldError(name, f"unrecognized request argument: {name}")
    for name, off in _OFF_VALUES.items():
        if name in b and name in allowed and not any(_same(b[name], v) for v in off):
            raise FieldError(name, f"{name}={b[name]!r} is not supported; {_why_off(name)}")
    model = b.get("model")
    if not isinstance(model, str) or not model:
        raise FieldError("model", "model must name the served model, e.g. " + card.model_id)
    if model != card.model_id:
        raise ModelNotFoundError(
            "model", f"model {model!r} is not served here; this server serves {card.model_id!r}"
        )
    for name in _BOOL_FIELDS:
        if name in b and not isinstance(b[name], bool):
            raise FieldError(name, f"{name} must be a boolean, got {b[name]!r}")
    stream = b.get("stream", False)
    include_usage = _stream_options(b, stream)
    plan = None
    if endpoint is Endpoint.COMPLETIONS:
        prompt = _completion_prompt(b, card)
        max_tokens_field = "max_tokens"
        default_max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        logprobs_field, logprobs = "logprobs", _int_or_none(b, "logprobs")
    else:
        if b.get("echo", False):
            raise FieldError("echo", "echo is only supported on /v1/completions")
        plan = parse_tools(b)
        prompt = _chat_prompt(b, card, plan)
        max_tokens_field = "max_completion_tokens" if "max_completion_tokens" in b else "max_tokens"
        default_max_tokens = card.max_model_len  # the engine stops at the context limit
        logprobs_field, logprobs = _chat_logprobs(b)
    echo = b.get("echo", False)
    prompt_only = echo and _same(b.get(max_tokens_field), 0)
    if prompt_only:  # log-likelihood: nothing generated that the client sees
        b[max_tokens_field] = DOWNSTREAM_MAX_TOKENS
    params = _sampling_params(
        b, card, (max_tokens_field, default_max_tokens), (logprobs_field, logprobs), plan
    )
    if echo and logprobs is not None:
        # As vLLM: the prompt's tokens get the same number of alternatives as the output's.
        params = dataclasses.replace(params, prompt_logprobs=logprobs)
    stop = b.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise FieldError("stop", f"stop must be a string or a list of strings, got {stop!r}")
    return OpenAIRequest(
        endpoint=endpoint,
        model=model,
        input=GenerateInput(
            request_id=None if request_id is None else check_request_id(request_id, "X-Request-Id"),
            params=params,
            stop=check_stop_strings(stop, "stop"),
            include_stop_str_in_output=b.get("include_stop_str_in_output", False),
            skip_special_tokens=b.get("skip_special_tokens", True),
            **prompt,
        ),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs is not None,
        tools=plan,
        echo=echo,
        prompt_only=prompt_only,
    )


def _stream_options(b: Mapping[str, Any], stream: bool) -> bool:
    options = b.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise FieldError("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, Mapping):
        raise FieldError("stream_options", f"stream_options must be an object, got {options!r}")
    for key in options:
        if key != "include_usage":
            raise FieldError(f"stream_options.{key}", f"stream_options.{key} is not supported")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise FieldError(
            "stream_options.include_usage",
            f"stream_options.include_usage must be a boolean, got {include!r}",
        )
    return include


def _completion_prompt(b: Mapping[str, Any], card: ModelCard) -> dict[str, Any]:
    """``prompt``: a string, a list of token ids, or a list holding one of those."""
    if "prompt" not in b:
        raise FieldError("prompt", "prompt is required")
    prompt, field = b["prompt"], "prompt"
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > 1:
            raise FieldError(
                "prompt",
                f"prompt holds {len(prompt)} prompts; this server takes one per request",
            )
        prompt, field = prompt[0], "prompt[0]"
    if isinstance(prompt, str):
        return {"text": check_text(prompt, max_prompt_chars(card), field), "prompt_path": field}
    if isinstance(prompt, list):
        return {"token_ids": check_token_ids(prompt, card, field), "prompt_path": field}
    raise FieldError(field, f"{field} must be a string or a list of token ids, got {_kind(prompt)}")


def _chat_prompt(b: Mapping[str, Any], card: ModelCard, plan: ToolPlan | None) -> dict[str, Any]:
    messages = b.get("messages")
    if not isinstance(messages, list):
        raise FieldError("messages", f"messages must be a list of messages, got {_kind(messages)}")
    check_chat_template(card, "messages", "use /v1/completions")
    pairs = []
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise FieldError(field, f"{field} must be an object, got {_kind(message)}")
        role = message.get("role")
        if role not in _MESSAGE_ROLES:
            raise FieldError(
                f"{field}.role",
                f"{field}.role must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r}",
            )
        for key, value in message.items():
            if key not in ("role", "content", *_MESSAGE_KEYS.get(role, ())) and value is not None:
                raise FieldError(f"{field}.{key}", f"{field}.{key} is not supported")
        if message.get("tool_calls") is not None:
            content = assistant_calls_text(message["tool_calls"], f"{field}.tool_calls")
        else:
            content = _content(message.get("content"), f"{field}.content")
        pairs.append((_MESSAGE_ROLES[role], content))
    turns = check_chat(with_tools_prompt(pairs, plan), max_prompt_chars(card), "messages")
    return {"chat": turns, "prompt_path": "messages"}


def _content(content: object, field: str) -> str:
    """A message's text: a string, or text parts (joined with newlines, as vLLM does)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise FieldError(
                    f"{field}[{j}]",
                    f"{field}[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                    f"got type {kind!r}: this server takes text only",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise FieldError(
        field, f"{field} must be a string or a list of text parts, got {_kind(content)}"
    )


def _chat_logprobs(b: Mapping[str, Any]) -> tuple[str, int | None]:
    """Chat: ``logprobs`` (bool) turns them on, ``top_logprobs`` (int) asks for alternatives."""
    on = b.get("logprobs", False)
    if not isinstance(on, bool):
        raise FieldError("logprobs", f"logprobs must be a boolean, got {on!r}")
    top = _int_or_none(b, "top_logprobs")
    if top is not None and not on:
        raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
    return "top_logprobs", (top or 0) if on else None


def _sampling_params(
    b: Mapping[str, Any],
    card: ModelCard,
    max_tokens: tuple[str, int],
    logprobs: tuple[str, int | None],
    plan: ToolPlan | None = None,
) -> SamplingParams:
    """``max_tokens``: the body field that sets it, and its default; ``logprobs``: the body
    field that sets it, and the top-n count (None: off)."""
    (max_tokens_field, default_max_tokens), (logprobs_field, num_logprobs) = max_tokens, logprobs
    values: dict[str, Any] = {
        field: b[name] for name, field in _SAMPLING_FIELDS.items() if name in b
    }
    if values.get("top_k") == -1:  # vLLM's spelling of "no top-k"
        values["top_k"] = 0
    values["max_tokens"] = b.get(max_tokens_field, default_max_tokens)
    values["logprobs"] = num_logprobs
    if "ignore_eos" in b:
        values["ignore_eos"] = b["ignore_eos"]
    if "stop_token_ids" in b:
        ids = b["stop_token_ids"]
        if not isinstance(ids, list):
            raise FieldError("stop_token_ids", f"stop_token_ids must be a list, got {ids!r}")
        values["stop_token_ids"] = tuple(ids)
    if "logit_bias" in b:
        values["logit_bias"] = _logit_bias(b["logit_bias"])
    names = {field: name for name, field in _SAMPLING_FIELDS.items()}
    names |= {"max_tokens": max_tokens_field, "logprobs": logprobs_field}
    names |= {"stop_token_ids": "stop_token_ids", "logit_bias": "logit_bias"}
    constraint = request_constraint(b)
    forced = plan.constraint() if plan is not None else None
    if forced is not None and constraint is not None:
        raise FieldError(
            constraint[1], f"{constraint[1]} cannot constrain a reply that must call a tool"
        )
    constraint = constraint or forced
    if constraint is not None:
        values["constraint"], names[constraint[0].field] = constraint

    def path(field: str) -> str:
        return names.get(field, field)

    try:
        params = SamplingParams(**values)
    except ValueError as exc:  # the message starts with the SamplingParams field name
        message = str(exc)
        field = next((f for f in sorted(names, key=len, reverse=True) if message.startswith(f)), "")
        raise FieldError(path(field), path(field) + message[len(field) :]) from exc
    check_sampling_params(params, card, path)
    return params


def _logit_bias(value: object) -> tuple[tuple[int, Any], ...]:
    """OpenAI's ``{"<token id>": bias}`` object -> (token id, bias) pairs; the ids are
    checked here (JSON keys are strings), the biases and the count by SamplingParams."""
    if not isinstance(value, Mapping):
        raise FieldError("logit_bias", f"logit_bias must be an object, got {_kind(value)}")
    if len(value) > MAX_LOGIT_BIAS:  # counted before any key is read
        raise FieldError(
            "logit_bias", f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS} allowed"
        )
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise FieldError(
                "logit_bias", f"logit_bias keys must be token ids (decimal integers), got {key!r}"
            )
        pairs.append((int(key), bias))
    return tuple(pairs)


def _int_or_none(b: Mapping[str, Any], name: str) -> int | None:
    value = b.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(name, f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise FieldError(name, f"{name} must be >= 0, got {value}")
    return value


def _same(value: object, off: object) -> bool:
    """JSON equality (so ``1.0`` is not ``True``, and ``n: 1.0`` still means one)."""
    if isinstance(off, bool) or isinstance(value, bool):
        return value is off
    if isinstance(off, int) and isinstance(value, int | float):
        return math.isfinite(value) and value == off
    return value == off


def _why_off(name: str) -> str:
    return {
        "best_of": "this server returns one choice per request (best_of=1)",
        "suffix": "insertion is not supported",
        "functions": "function calling is not supported",
        "function_call": "function calling is not supported",
        "modalities": "only text output is supported",
        "store": "completions are not stored",
    }[name]
