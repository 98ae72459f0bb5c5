"""The gateway's edge checks: the rules every request is held to, through either front end,
and the typed :class:`GenerateInput` a validated request becomes.

Everything a client controls is checked here, before any tokenizing or routing, counts
and lengths before contents (nothing is copied out of an oversized list), and every
failure is a :class:`FieldError` (a ``ValueError``) whose message starts with the field's
path (``sampling_params.temperature``, ``stop[2]``, ``token_ids.ids[5]``,
``chat.messages[1].role``), which the error interceptor returns as INVALID_ARGUMENT and
the HTTP front end as 400.

The checks (``check_*``) take plain values and the path to name, so each front end
applies the very same rules under its own field names: gateway.grpc_api.request to a wire
``GenerateRequest``, gateway.http.request to an OpenAI body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.constraint import Constraint, ConstraintKind
from engine.grammar import check_constraint
from engine.sampling_params import SamplingParams
from gateway.text.chat import ChatTurn

if TYPE_CHECKING:
    from gateway.served_model import ModelCard

# "tool": a tool's result, in reply to an assistant's tool call (gateway.tools.plan).
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
# Prompt text longer than this many characters per token of max_model_len cannot fit, and
# is refused before it ties up the tokenizer thread.
MAX_CHARS_PER_TOKEN = 32


class FieldError(ValueError):
    """Bad input in one named request field; ``field`` is its path (``stop[2]``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLongError(FieldError):
    """The prompt leaves no room for a generated token within max_model_len."""


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """A validated Generate request. Exactly one of ``text``, ``chat``, ``token_ids`` is set."""

    request_id: str | None  # None: the gateway makes one
    params: SamplingParams
    text: str | None = None
    chat: tuple[ChatTurn, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The request field that carried the prompt, named in errors; None: the proto field.
    prompt_path: str | None = None

    @property
    def prompt_field(self) -> str:
        """The request field that carried the prompt, for error messages."""
        if self.prompt_path is not None:
            return self.prompt_path
        if self.text is not None:
            return "text"
        if self.chat is not None:
            return "chat"
        return "token_ids"


def check_prompt_length(field: str, num_tokens: int, card: ModelCard) -> None:
    """A prompt must leave room for at least one generated token."""
    if num_tokens == 0:
        raise FieldError(field, f"{field} is empty after tokenization")
    if num_tokens >= card.max_model_len:
        raise PromptTooLongError(
            field,
            f"{field} has {num_tokens} tokens; at most {card.max_model_len - 1} fit "
            f"(max_model_len {card.max_model_len} includes at least one output token)",
        )


def max_prompt_chars(card: ModelCard) -> int:
    """The most prompt characters worth tokenizing for ``card`` (see MAX_CHARS_PER_TOKEN)."""
    return MAX_CHARS_PER_TOKEN * card.max_model_len


def check_sampling_params(
    params: SamplingParams, card: ModelCard, path: Callable[[str], str]
) -> None:
    """What SamplingParams cannot check alone: the model's vocabulary and logprobs limit.
    ``path`` turns a SamplingParams field name into the request's field path."""
    try:
        params.validate_vocab(card.vocab_size)
    except ValueError as exc:  # "stop_token_ids contains ..." / "logit_bias names ..."
        name = str(exc).split(" ", 1)[0]
        field = path(name)
        raise FieldError(field, field + str(exc).removeprefix(name)) from exc
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > card.max_logprobs:
            raise FieldError(
                path(name), f"{path(name)} must be <= {card.max_logprobs}, got {value}"
            )
    if params.constraint is not None:
        check_constraint_compiles(params.constraint, path)


def check_constraint_compiles(constraint: Constraint, path: Callable[[str], str]) -> None:
    """A schema, regex or grammar must compile (within the compile limits) before the
    request is queued anywhere; ``path`` names the field that carried it."""
    try:
        check_constraint(constraint)
    except ValueError as exc:  # "json_schema does not compile: ..."
        field = path(constraint.field)
        raise FieldError(field, field + str(exc).removeprefix(constraint.field)) from exc


def check_request_id(rid: str, field: str) -> str:
    if not 0 < len(rid) <= MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise FieldError(
            field,
            f"{field} must be 1 to {MAX_REQUEST_ID_CHARS} printable characters, got "
            f"{rid[: MAX_REQUEST_ID_CHARS + 1]!r}",
        )
    return rid


def check_stop_strings(stop: Sequence[str], field: str) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise FieldError(
            field, f"{field} has {len(stop)} entries; at most {MAX_STOP_STRINGS} allowed"
        )
    for i, s in enumerate(stop):
        if not s:
            raise FieldError(f"{field}[{i}]", f"{field}[{i}] must be non-empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise FieldError(
                f"{field}[{i}]",
                f"{field}[{i}] has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} allowed",
            )
    return tuple(stop)


def check_count(count: int, limit: int, field: str) -> None:
    """A list is checked by its length before its items are read."""
    if count > limit:
        raise FieldError(field, f"{field} has {count} entries; at most {limit} allowed")


def check_text(text: str, max_chars: int, field: str) -> str:
    if not text:
        raise FieldError(field, f"{field} must be non-empty")
    if len(text) > max_chars:
        raise FieldError(field, f"{field} has {len(text)} characters; at most {max_chars} allowed")
    return text


def check_chat_template(card: ModelCard, field: str, instead: str) -> None:
    if not card.has_chat_template:
        raise FieldError(field, f"{field}: model {card.model_id} has no chat template; {instead}")


def check_chat(
    messages: Sequence[tuple[str, str]], max_chars: int, field: str
) -> tuple[ChatTurn, ...]:
    """(role, content) pairs -> turns; ``field`` names the message list."""
    if not messages:
        raise FieldError(field, f"{field} must hold at least one message")
    turns = []
    total = 0
    for i, (role, content) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise FieldError(
                f"{field}[{i}].role",
                f"{field}[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
            )
        if not content:
            raise FieldError(f"{field}[{i}].content", f"{field}[{i}].content must be non-empty")
        total += len(content)
        turns.append(ChatTurn(role=role, content=content))
    if total > max_chars:
        raise FieldError(field, f"{field} hold {total} characters; at most {max_chars} allowed")
    return tuple(turns)


def check_token_ids(ids: Sequence[int], card: ModelCard, field: str) -> tuple[int, ...]:
    # The count first: nothing is copied or scanned for a prompt that cannot fit.
    if not len(ids):
        raise FieldError(field, f"{field} must be non-empty")
    check_prompt_length(field, len(ids), card)
    ids = tuple(ids)
    for i, token in enumerate(ids):
        if (
            isinstance(token, bool)
            or not isinstance(token, int)
            or not 0 <= token < card.vocab_size
        ):
            raise FieldError(
                f"{field}[{i}]",
                f"{field}[{i}] is {token!r}, outside the vocabulary [0, {card.vocab_size})",
            )
    return ids


def json_kind(value: object) -> str:
    """What a decoded JSON value is, for a message naming a field of the wrong type."""
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "a string" if isinstance(value, str) else repr(value)


def schema_constraint(schema: object, path: str) -> Constraint:
    """A JSON schema (an object) as a constraint; its text is canonical, so the same
    schema compiles once whatever its key order."""
    if not isinstance(schema, Mapping):
        raise FieldError(path, f"{path} must be a JSON schema object, got {json_kind(schema)}")
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return make_constraint(ConstraintKind.JSON_SCHEMA, path, spec=text)


def make_constraint(kind: ConstraintKind, path: str, **fields: Any) -> Constraint:
    """A constraint built from a request field at ``path``; its own error names the field."""
    try:
        return Constraint(kind, **fields)
    except ValueError as exc:  # "choice[2] must be ..." / "regex must be ..."
        message = str(exc).removeprefix(kind.value)
        raise FieldError(path, f"{path}{message}") from exc
