"""The gateway's edge check: a wire ``GenerateRequest`` in, a typed :class:`GenerateInput` out.

Everything a client controls is checked here, before any tokenizing or routing, and every
failure is a ``ValueError`` whose message starts with the proto field's path
(``sampling_params.temperature``, ``stop[2]``, ``token_ids.ids[5]``, ``chat.messages[1].role``),
which the error interceptor returns as INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from protos.baton.v1 import generate_pb2
from rpc.convert import sampling_params_from_proto

if TYPE_CHECKING:
    from gateway.served_model import ModelCard

CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
# Prompt text longer than this many characters per token of max_model_len cannot fit, and
# is refused before it ties up the tokenizer thread.
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One validated chat message."""

    role: str
    content: str


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

    @property
    def prompt_field(self) -> str:
        """The proto field that carried the prompt, for error messages."""
        if self.text is not None:
            return "text"
        if self.chat is not None:
            return "chat"
        return "token_ids"


def validate_generate_request(msg: generate_pb2.GenerateRequest, card: ModelCard) -> GenerateInput:
    """Check ``msg`` against the served model; raises ValueError naming the bad field."""
    request_id = _request_id(msg)
    params = sampling_params_from_proto(msg.sampling_params)
    try:
        params.validate_vocab(card.vocab_size)
    except ValueError as exc:
        raise ValueError(f"sampling_params.{exc}") from exc
    if params.logprobs is not None and params.logprobs > card.max_logprobs:
        raise ValueError(
            f"sampling_params.logprobs must be <= {card.max_logprobs}, got {params.logprobs}"
        )
    text: str | None = None
    turns: tuple[ChatTurn, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    kind = msg.WhichOneof("prompt")
    max_chars = MAX_CHARS_PER_TOKEN * card.max_model_len
    if kind == "text":
        text = _text(msg.text, max_chars)
    elif kind == "chat":
        if not card.has_chat_template:
            raise ValueError(
                f"chat: model {card.model_id} has no chat template; send text or token_ids"
            )
        turns = _chat(msg.chat, max_chars)
    elif kind == "token_ids":
        token_ids = _token_ids(msg.token_ids, card)
    else:
        raise ValueError("prompt must be set: one of text, chat or token_ids")
    return GenerateInput(
        request_id=request_id,
        params=params,
        text=text,
        chat=turns,
        token_ids=token_ids,
        stop=_stop_strings(msg),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        ),
    )


def check_prompt_length(field: str, num_tokens: int, card: ModelCard) -> None:
    """A prompt must leave room for at least one generated token."""
    if num_tokens == 0:
        raise ValueError(f"{field} is empty after tokenization")
    if num_tokens >= card.max_model_len:
        raise ValueError(
            f"{field} has {num_tokens} tokens; at most {card.max_model_len - 1} fit "
            f"(max_model_len {card.max_model_len} includes at least one output token)"
        )


def _request_id(msg: generate_pb2.GenerateRequest) -> str | None:
    if not msg.HasField("request_id"):
        return None
    rid = msg.request_id
    if not 0 < len(rid) <= MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise ValueError(
            f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable characters, got "
            f"{rid[: MAX_REQUEST_ID_CHARS + 1]!r}"
        )
    return rid


def _stop_strings(msg: generate_pb2.GenerateRequest) -> tuple[str, ...]:
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(msg.stop)} entries; at most {MAX_STOP_STRINGS} allowed")
    for i, stop in enumerate(msg.stop):
        if not stop:
            raise ValueError(f"stop[{i}] must be non-empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop[{i}] has {len(stop)} characters; at most {MAX_STOP_STRING_CHARS} allowed"
            )
    return tuple(msg.stop)


def _text(text: str, max_chars: int) -> str:
    if not text:
        raise ValueError("text must be non-empty")
    if len(text) > max_chars:
        raise ValueError(f"text has {len(text)} characters; at most {max_chars} allowed")
    return text


def _chat(chat: generate_pb2.ChatMessages, max_chars: int) -> tuple[ChatTurn, ...]:
    if not chat.messages:
        raise ValueError("chat.messages must hold at least one message")
    turns = []
    total = 0
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise ValueError(
                f"chat.messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                f"got {message.role!r}"
            )
        if not message.content:
            raise ValueError(f"chat.messages[{i}].content must be non-empty")
        total += len(message.content)
        turns.append(ChatTurn(role=message.role, content=message.content))
    if total > max_chars:
        raise ValueError(f"chat.messages hold {total} characters; at most {max_chars} allowed")
    return tuple(turns)


def _token_ids(msg: generate_pb2.TokenIds, card: ModelCard) -> tuple[int, ...]:
    ids = tuple(msg.ids)
    if not ids:
        raise ValueError("token_ids.ids must be non-empty")
    if max(ids) >= card.vocab_size:
        i = next(i for i, token in enumerate(ids) if token >= card.vocab_size)
        raise ValueError(
            f"token_ids.ids[{i}] is {ids[i]}, outside the vocabulary [0, {card.vocab_size})"
        )
    check_prompt_length("token_ids.ids", len(ids), card)
    return ids
