"""gateway.http.request: OpenAI bodies -> GenerateInput, and every refusal names its field.

``REFUSED`` (unsupported fields and bad values, with the ``param`` each must name) is
shared with the end-to-end test, which sends each one through the official client.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.http.request import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Endpoint,
    ModelNotFoundError,
    parse_request,
)
from gateway.served_model import ModelCard
from gateway.text.chat import ChatTurn
from gateway.validation import FieldError, PromptTooLongError

CARD = ModelCard(
    model_id="m", vocab_size=1000, max_model_len=64, eos_token_ids=(2,), has_chat_template=True
)
COMPLETIONS, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT
USER = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# (id, endpoint, body, the param the 400 must name)
REFUSED: list[tuple[str, Endpoint, dict[str, Any], str]] = [
    ("n-zero", COMPLETIONS, completion(n=0), "n"),
    ("chat-n-too-many", CHAT, chat(n=17), "n"),
    ("n-type", COMPLETIONS, completion(n=2.5), "n"),
    ("best-of", COMPLETIONS, completion(best_of=2), "best_of"),
    ("echo-chat", CHAT, chat(echo=True), "echo"),
    ("echo-type", COMPLETIONS, completion(echo="yes"), "echo"),
    ("suffix", COMPLETIONS, completion(suffix="end"), "suffix"),
    ("logit-bias-range", COMPLETIONS, completion(logit_bias={"5": 100.5}), "logit_bias"),
    ("chat-logit-bias-vocab", CHAT, chat(logit_bias={"4000000000": -100}), "logit_bias"),
    ("logit-bias-key", COMPLETIONS, completion(logit_bias={"x5": 1}), "logit_bias"),
    ("logit-bias-type", CHAT, chat(logit_bias=[5, -100]), "logit_bias"),
    ("logit-bias-value", COMPLETIONS, completion(logit_bias={"5": "ban"}), "logit_bias"),
    (
        "tool-name",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "no spaces", "parameters": {}}}]),
        "tools[0].function.name",
    ),
    (
        "tool-parameters-invalid",
        CHAT,
        chat(
            tools=[
                TOOL,
                {"type": "function", "function": {"name": "g", "parameters": {"type": 5}}},
            ],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        "tools[1].function.parameters",
    ),
    (
        "tool-choice-unlisted",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "h"}}),
        "tool_choice.function.name",
    ),
    (
        "tool-choice-and-format",
        CHAT,
        chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
    ),
    ("tool-choice", CHAT, chat(tool_choice="required"), "tool_choice"),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), "functions"),
    (
        "json-schema-invalid",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}),
        "response_format.json_schema.schema",
    ),
    (
        "json-schema-unsupported-keyword",
        COMPLETIONS,
        completion(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"unevaluatedProperties": False}},
            }
        ),
        "response_format.json_schema.schema",
    ),
    ("format-type", CHAT, chat(response_format={"type": "yaml"}), "response_format.type"),
    ("regex-unclosed", COMPLETIONS, completion(guided_regex="[a-z]+("), "guided_regex"),
    ("choice-empty", CHAT, chat(structured_outputs={"choice": []}), "structured_outputs.choice"),
    ("grammar-unknown-rule", CHAT, chat(guided_grammar="start: foo"), "guided_grammar"),
    (
        "two-constraints",
        CHAT,
        chat(response_format={"type": "json_object"}, guided_regex="a+"),
        "guided_regex",
    ),
    ("audio", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("unknown", COMPLETIONS, completion(frobnicate=1), "frobnicate"),
    ("chat-field-on-completions", COMPLETIONS, completion(messages=USER), "messages"),
    (
        "stream-options-without-stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        "stream_options",
    ),
    ("temperature", COMPLETIONS, completion(temperature=-1), "temperature"),
    ("temperature-type", CHAT, chat(temperature="hot"), "temperature"),
    ("top-p", COMPLETIONS, completion(top_p=0), "top_p"),
    ("max-tokens", COMPLETIONS, completion(max_tokens=0), "max_tokens"),
    ("max-completion-tokens", CHAT, chat(max_completion_tokens=-5), "max_completion_tokens"),
    ("seed", CHAT, chat(seed=-1), "seed"),
    ("presence", CHAT, chat(presence_penalty=3), "presence_penalty"),
    ("frequency", COMPLETIONS, completion(frequency_penalty=-2.5), "frequency_penalty"),
    ("logprobs-too-many", COMPLETIONS, completion(logprobs=21), "logprobs"),
    ("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), "top_logprobs"),
    ("chat-logprobs-int", CHAT, chat(logprobs=3), "logprobs"),
    ("stop-type", COMPLETIONS, completion(stop=5), "stop"),
    ("stop-empty", COMPLETIONS, completion(stop=["a", ""]), "stop[1]"),
    ("stream-type", COMPLETIONS, completion(stream="yes"), "stream"),
    ("prompt-missing", COMPLETIONS, {"model": "m"}, "prompt"),
    ("prompt-empty", COMPLETIONS, completion(prompt=""), "prompt"),
    ("prompt-batch", COMPLETIONS, completion(prompt=["a", "b"]), "prompt"),
    ("prompt-id-outside-vocab", COMPLETIONS, completion(prompt=[1, 10**9]), "prompt[1]"),
    ("messages-empty", CHAT, chat(messages=[]), "messages"),
    (
        "messages-role",
        CHAT,
        chat(messages=[{"role": "function", "content": "x"}]),
        "messages[0].role",
    ),
    (
        "messages-name",
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "name": "bob"}]),
        "messages[0].name",
    ),
    (
        "messages-image",
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        "messages[0].content[0]",
    ),
    ("model-missing", COMPLETIONS, {"prompt": "hi"}, "model"),
    ("stop-token-outside-vocab", COMPLETIONS, completion(stop_token_ids=[10**9]), "stop_token_ids"),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_refusals_name_their_field(endpoint: Endpoint, body: dict[str, Any], param: str) -> None:
    with pytest.raises(FieldError) as info:
        parse_request(endpoint, body, CARD, None)
    assert info.value.field == param, str(info.value)
    assert str(info.value).startswith(param) or param in str(info.value), str(info.value)


def test_unknown_model_is_its_own_error() -> None:
    with pytest.raises(ModelNotFoundError, match="'gpt-4' is not served here") as info:
        parse_request(COMPLETIONS, completion(model="gpt-4"), CARD, None)
    assert info.value.field == "model"


def test_off_values_and_nulls_are_accepted() -> None:
    got = parse_request(
        CHAT,
        chat(
            n=1,
            tools=[],
            tool_choice="none",
            logit_bias={},
            response_format={"type": "text"},
            user="alice",
            parallel_tool_calls=False,
            temperature=None,
            seed=None,
            stop=None,
        ),
        CARD,
        None,
    )
    assert got.input.params.temperature == 1.0 and got.input.params.seed is None
    assert got.input.stop == ()


def test_completion_defaults() -> None:
    got = parse_request(COMPLETIONS, completion(), CARD, None)
    assert got.endpoint is COMPLETIONS and got.model == "m"
    assert got.input.text == "hi" and got.input.prompt_field == "prompt"
    assert got.input.params.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert got.input.params.logprobs is None and not got.logprobs
    assert not got.stream and not got.include_usage
    assert got.input.request_id is None


def test_chat_defaults_to_the_context_limit() -> None:
    got = parse_request(CHAT, chat(), CARD, "my-id")
    assert got.input.chat == (ChatTurn("user", "hi"),)
    assert got.input.params.max_tokens == CARD.max_model_len
    assert got.input.request_id == "my-id"
    assert got.input.prompt_field == "messages"


def test_every_field_is_mapped() -> None:
    got = parse_request(
        COMPLETIONS,
        completion(
            prompt=[[5, 6, 7]],
            max_tokens=9,
            temperature=0,
            top_p=0.5,
            top_k=-1,
            min_p=0.2,
            seed=3,
            presence_penalty=1,
            frequency_penalty=-1,
            repetition_penalty=1.1,
            min_tokens=2,
            ignore_eos=True,
            stop_token_ids=[4],
            stop="\n",
            logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
            include_stop_str_in_output=True,
            skip_special_tokens=False,
        ),
        CARD,
        None,
    )
    p = got.input.params
    assert got.input.token_ids == (5, 6, 7) and got.input.prompt_field == "prompt[0]"
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (
        9,
        0,
        0.5,
        0,
        0.2,
        3,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, -1, 1.1)
    assert (p.min_tokens, p.ignore_eos, p.stop_token_ids, p.logprobs) == (2, True, (4,), 3)
    assert got.input.stop == ("\n",)
    assert got.stream and got.include_usage and got.logprobs
    assert got.input.include_stop_str_in_output and not got.input.skip_special_tokens


def test_chat_content_parts_roles_and_logprobs() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        },
        {"role": "assistant", "content": "ok", "refusal": None},
    ]
    got = parse_request(
        CHAT,
        chat(messages=messages, max_tokens=3, max_completion_tokens=5, logprobs=True),
        CARD,
        None,
    )
    assert got.input.chat == (
        ChatTurn("system", "Be brief."),
        ChatTurn("user", "one\ntwo"),
        ChatTurn("assistant", "ok"),
    )
    assert got.input.params.max_tokens == 5  # max_completion_tokens wins over max_tokens
    assert got.input.params.logprobs == 0 and got.logprobs


def test_chat_needs_a_template() -> None:
    card = ModelCard("m", vocab_size=10, max_model_len=8, eos_token_ids=(), has_chat_template=False)
    with pytest.raises(FieldError, match="no chat template; use /v1/completions"):
        parse_request(CHAT, chat(), card, None)


def test_token_prompt_too_long_is_a_prompt_too_long_error() -> None:
    with pytest.raises(PromptTooLongError) as info:
        parse_request(COMPLETIONS, completion(prompt=[1] * CARD.max_model_len), CARD, None)
    assert info.value.field == "prompt"


@pytest.mark.parametrize("body", [[1], "text", None])
def test_body_must_be_an_object(body: Any) -> None:
    with pytest.raises(FieldError, match="must be a JSON object"):
        parse_request(COMPLETIONS, body, CARD, None)


def test_request_id_header_is_checked() -> None:
    with pytest.raises(FieldError) as info:
        parse_request(COMPLETIONS, completion(), CARD, "a\nb")
    assert info.value.field == "X-Request-Id"
