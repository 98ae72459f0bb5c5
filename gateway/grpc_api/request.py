"""A wire ``baton.v1.GenerateRequest`` -> the gateway's validated :class:`GenerateInput`.

The gRPC twin of gateway.http.request: the proto's fields are checked by the shared rules
of gateway.validation, under the proto's field paths (``sampling_params.temperature``,
``chat.messages[1].role``), so a failure is a :class:`FieldError` that the error
interceptor returns as INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.text.chat import ChatTurn
from gateway.validation import (
    FieldError,
    GenerateInput,
    check_chat,
    check_chat_template,
    check_count,
    check_request_id,
    check_sampling_params,
    check_stop_strings,
    check_text,
    check_token_ids,
    max_prompt_chars,
)
from protos.baton.v1 import generate_pb2
from rpc.convert import sampling_params_from_proto

if TYPE_CHECKING:
    from gateway.served_model import ModelCard


def validate_generate_request(msg: generate_pb2.GenerateRequest, card: ModelCard) -> GenerateInput:
    """Check ``msg`` against the served model; raises ValueError naming the bad field."""
    request_id = (
        check_request_id(msg.request_id, "request_id") if msg.HasField("request_id") else None
    )
    if msg.sampling_params.output_offset:
        raise FieldError(
            "sampling_params.output_offset",
            "sampling_params.output_offset is set by the gateway when it moves a request "
            "between decode workers; a Generate request must leave it unset",
        )
    try:
        params = sampling_params_from_proto(msg.sampling_params)
    except ValueError as exc:  # the message starts with sampling_params.<field>
        raise FieldError(str(exc).split(" ", 1)[0].rstrip(":"), str(exc)) from exc
    check_sampling_params(params, card, lambda name: f"sampling_params.{name}")
    text: str | None = None
    turns: tuple[ChatTurn, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    kind = msg.WhichOneof("prompt")
    max_chars = max_prompt_chars(card)
    if kind == "text":
        text = check_text(msg.text, max_chars, "text")
    elif kind == "chat":
        check_chat_template(card, "chat", "send text or token_ids")
        check_count(len(msg.chat.messages), max_chars, "chat.messages")
        turns = check_chat(
            [(m.role, m.content) for m in msg.chat.messages], max_chars, "chat.messages"
        )
    elif kind == "token_ids":
        token_ids = check_token_ids(msg.token_ids.ids, card, "token_ids.ids")
    else:
        raise FieldError("prompt", "prompt must be set: one of text, chat or token_ids")
    return GenerateInput(
        request_id=request_id,
        params=params,
        text=text,
        chat=turns,
        token_ids=token_ids,
        stop=check_stop_strings(msg.stop, "stop"),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        ),
    )
