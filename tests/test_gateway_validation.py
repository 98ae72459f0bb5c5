"""gateway.grpc_api.request and gateway.validation: every malformed GenerateRequest is a
ValueError naming its field.

``BAD_REQUESTS`` is shared with the over-the-wire test in test_gateway_service.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from gateway.grpc_api.request import validate_generate_request
from gateway.served_model import ModelCard
from gateway.text.chat import ChatTurn
from gateway.validation import MAX_CHARS_PER_TOKEN, check_prompt_length
from protos.baton.v1 import common_pb2, generate_pb2

CARD = ModelCard(
    model_id="test",
    vocab_size=1000,
    max_model_len=64,
    eos_token_ids=(2,),
    has_chat_template=True,
)


def req(**fields: object) -> generate_pb2.GenerateRequest:
    """A request with ``text="hi"`` unless another prompt (or ``prompt=None``) is given."""
    if not {"text", "chat", "token_ids"} & fields.keys() and fields.pop("prompt", 1) is not None:
        fields["text"] = "hi"
    return generate_pb2.GenerateRequest(**fields)


def sp(**fields: object) -> common_pb2.SamplingParameters:
    return common_pb2.SamplingParameters(**fields)


def chat(*messages: tuple[str, str]) -> generate_pb2.ChatMessages:
    return generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in messages]
    )


# (id, request for a model card, the field its error must start with)
BAD_REQUESTS: list[tuple[str, Callable[[ModelCard], generate_pb2.GenerateRequest], str]] = [
    ("no-prompt", lambda c: req(prompt=None), "prompt"),
    ("empty-text", lambda c: req(text=""), "text"),
    ("huge-text", lambda c: req(text="a" * (MAX_CHARS_PER_TOKEN * c.max_model_len + 1)), "text"),
    ("chat-no-messages", lambda c: req(chat=chat()), "chat.messages"),
    (
        "chat-bad-role",
        lambda c: req(chat=chat(("user", "hi"), ("robot", "beep"))),
        "chat.messages[1].role",
    ),
    ("chat-empty-content", lambda c: req(chat=chat(("user", ""))), "chat.messages[0].content"),
    ("token-ids-empty", lambda c: req(token_ids=generate_pb2.TokenIds()), "token_ids.ids"),
    (
        "token-id-outside-vocab",
        lambda c: req(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3, 4, 5, c.vocab_size])),
        "token_ids.ids[5]",
    ),
    (
        "token-ids-too-long",
        lambda c: req(token_ids=generate_pb2.TokenIds(ids=[1] * c.max_model_len)),
        "token_ids.ids",
    ),
    ("stop-empty", lambda c: req(stop=["a", "b", ""]), "stop[2]"),
    ("stop-too-many", lambda c: req(stop=[str(i) for i in range(17)]), "stop"),
    ("stop-too-long", lambda c: req(stop=["x" * 257]), "stop[0]"),
    ("request-id-empty", lambda c: req(request_id=""), "request_id"),
    ("request-id-long", lambda c: req(request_id="r" * 129), "request_id"),
    ("request-id-control", lambda c: req(request_id="a\nb"), "request_id"),
    (
        "temperature-negative",
        lambda c: req(sampling_params=sp(temperature=-1)),
        "sampling_params.temperature",
    ),
    (
        "temperature-nan",
        lambda c: req(sampling_params=sp(temperature=math.nan)),
        "sampling_params.temperature",
    ),
    ("top-p-zero", lambda c: req(sampling_params=sp(top_p=0)), "sampling_params.top_p"),
    (
        "max-tokens-zero",
        lambda c: req(sampling_params=sp(max_tokens=0)),
        "sampling_params.max_tokens",
    ),
    (
        "min-tokens-over-max",
        lambda c: req(sampling_params=sp(max_tokens=2, min_tokens=3)),
        "sampling_params.min_tokens",
    ),
    (
        "logprobs-too-many",
        lambda c: req(sampling_params=sp(logprobs=21)),
        "sampling_params.logprobs",
    ),
    (
        "stop-token-outside-vocab",
        lambda c: req(sampling_params=sp(stop_token_ids=[c.vocab_size])),
        "sampling_params.stop_token_ids",
    ),
]
BAD_IDS = [case[0] for case in BAD_REQUESTS]


@pytest.mark.parametrize(("build", "field"), [c[1:] for c in BAD_REQUESTS], ids=BAD_IDS)
def test_bad_request_names_its_field(
    build: Callable[[ModelCard], generate_pb2.GenerateRequest], field: str
) -> None:
    with pytest.raises(ValueError) as info:
        validate_generate_request(build(CARD), CARD)
    assert str(info.value).startswith(field), str(info.value)


def test_chat_without_a_template_names_chat() -> None:
    card = ModelCard(
        "plain", vocab_size=10, max_model_len=8, eos_token_ids=(), has_chat_template=False
    )
    with pytest.raises(ValueError, match=r"^chat: model plain has no chat template"):
        validate_generate_request(req(chat=chat(("user", "hi"))), card)


def test_defaults() -> None:
    got = validate_generate_request(req(), CARD)
    assert (got.text, got.chat, got.token_ids) == ("hi", None, None)
    assert got.request_id is None
    assert got.stop == ()
    assert got.include_stop_str_in_output is False
    assert got.skip_special_tokens is True
    assert got.params.max_tokens == 16
    assert got.prompt_field == "text"


def test_every_field_is_carried() -> None:
    got = validate_generate_request(
        req(
            request_id="my-id 1",
            chat=chat(("system", "be brief"), ("user", "hi")),
            sampling_params=sp(temperature=0, max_tokens=5, logprobs=2, stop_token_ids=[7]),
            stop=["\n", "END"],
            include_stop_str_in_output=True,
            skip_special_tokens=False,
        ),
        CARD,
    )
    assert got.request_id == "my-id 1"
    assert got.chat == (ChatTurn("system", "be brief"), ChatTurn("user", "hi"))
    assert got.prompt_field == "chat"
    assert (got.params.temperature, got.params.max_tokens, got.params.logprobs) == (0, 5, 2)
    assert got.params.stop_token_ids == (7,)
    assert got.stop == ("\n", "END")
    assert got.include_stop_str_in_output and not got.skip_special_tokens


def test_token_ids_prompt() -> None:
    got = validate_generate_request(req(token_ids=generate_pb2.TokenIds(ids=[0, 999])), CARD)
    assert got.token_ids == (0, 999)
    assert got.prompt_field == "token_ids"


def test_prompt_length_leaves_room_for_one_token() -> None:
    check_prompt_length("text", CARD.max_model_len - 1, CARD)
    with pytest.raises(ValueError, match=r"^text has 64 tokens; at most 63"):
        check_prompt_length("text", CARD.max_model_len, CARD)
    with pytest.raises(ValueError, match=r"^chat is empty"):
        check_prompt_length("chat", 0, CARD)
