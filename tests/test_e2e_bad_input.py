"""Malformed requests through the real gateway and a real worker: each is refused with its
exact status code and a message that starts with the offending field's path, nothing is
allocated for it, and the server keeps serving.

A single-process cluster of the tiny model (vocabulary 49152, max_model_len 1024) is
enough: validation happens at the gateway's edge and in the worker's engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from protos.baton.v1 import common_pb2, generate_pb2
from tests.e2e_helpers import (
    E2ECluster,
    assert_completed,
    gateway_stub,
    generate,
    ids_request,
    prompt_ids,
    tiny_cluster,
    wait_settled,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
Info = generate_pb2.ModelInfoResponse


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(tiny_llama, mode="single", decode_args=("--num-blocks", "128")) as c:
        yield c


def req(**fields: object) -> generate_pb2.GenerateRequest:
    """A request with ``text="Hello"`` unless another prompt (or ``prompt=None``) is given."""
    if not {"text", "chat", "token_ids"} & fields.keys() and fields.pop("prompt", 1) is not None:
        fields["text"] = "Hello"
    return generate_pb2.GenerateRequest(**fields)


def sp(**fields: object) -> common_pb2.SamplingParameters:
    return common_pb2.SamplingParameters(**fields)


def chat(*messages: tuple[str, str]) -> generate_pb2.ChatMessages:
    return generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in messages]
    )


def ids(*token_ids: int) -> generate_pb2.TokenIds:
    return generate_pb2.TokenIds(ids=token_ids)


# (id, request for the served model, the field path its error message must start with)
BAD: list[tuple[str, Callable[[Info], generate_pb2.GenerateRequest], str]] = [
    ("no-prompt", lambda i: req(prompt=None), "prompt"),
    ("empty-text", lambda i: req(text=""), "text"),
    ("text-over-char-limit", lambda i: req(text="a" * (32 * i.max_model_len + 1)), "text"),
    # Under the character limit, but more tokens than the model holds: caught after tokenizing.
    ("text-over-max-model-len", lambda i: req(text=" hello" * (i.max_model_len + 10)), "text"),
    ("token-ids-empty", lambda i: req(token_ids=ids()), "token_ids.ids"),
    (
        "token-id-outside-vocab",
        lambda i: req(token_ids=ids(1, 2, i.vocab_size)),
        "token_ids.ids[2]",
    ),
    (
        "token-ids-fill-max-model-len",
        lambda i: req(token_ids=ids(*prompt_ids(i.max_model_len, "too-long"))),
        "token_ids.ids",
    ),
    ("chat-no-messages", lambda i: req(chat=chat()), "chat.messages"),
    (
        "chat-bad-role",
        lambda i: req(chat=chat(("user", "hi"), ("robot", "x"))),
        "chat.messages[1].role",
    ),
    ("chat-empty-content", lambda i: req(chat=chat(("system", ""))), "chat.messages[0].content"),
    (
        "chat-over-max-model-len",
        lambda i: req(chat=chat(("user", " hello" * (i.max_model_len + 10)))),
        "chat",
    ),
    (
        "temperature-negative",
        lambda i: req(sampling_params=sp(temperature=-0.5)),
        "sampling_params.temperature",
    ),
    (
        "temperature-inf",
        lambda i: req(sampling_params=sp(temperature=float("inf"))),
        "sampling_params.temperature",
    ),
    ("top-p-zero", lambda i: req(sampling_params=sp(top_p=0)), "sampling_params.top_p"),
    ("top-p-over-one", lambda i: req(sampling_params=sp(top_p=1.5)), "sampling_params.top_p"),
    ("min-p-over-one", lambda i: req(sampling_params=sp(min_p=1.5)), "sampling_params.min_p"),
    (
        "max-tokens-zero",
        lambda i: req(sampling_params=sp(max_tokens=0)),
        "sampling_params.max_tokens",
    ),
    (
        "min-tokens-over-max-tokens",
        lambda i: req(sampling_params=sp(max_tokens=2, min_tokens=3)),
        "sampling_params.min_tokens",
    ),
    (
        "logprobs-too-many",
        lambda i: req(sampling_params=sp(logprobs=i.max_logprobs + 1)),
        "sampling_params.logprobs",
    ),
    ("seed-too-large", lambda i: req(sampling_params=sp(seed=2**63)), "sampling_params.seed"),
    (
        "repetition-penalty-zero",
        lambda i: req(sampling_params=sp(repetition_penalty=0)),
        "sampling_params.repetition_penalty",
    ),
    (
        "presence-penalty-out-of-range",
        lambda i: req(sampling_params=sp(presence_penalty=2.5)),
        "sampling_params.presence_penalty",
    ),
    (
        "frequency-penalty-out-of-range",
        lambda i: req(sampling_params=sp(frequency_penalty=-3)),
        "sampling_params.frequency_penalty",
    ),
    (
        "stop-token-outside-vocab",
        lambda i: req(sampling_params=sp(stop_token_ids=[5, i.vocab_size])),
        "sampling_params.stop_token_ids",
    ),
    (
        "too-many-stop-token-ids",
        lambda i: req(sampling_params=sp(stop_token_ids=list(range(3, 3 + 65)))),
        "sampling_params.stop_token_ids",
    ),
    ("too-many-stop-strings", lambda i: req(stop=[f"s{n}" for n in range(17)]), "stop"),
    ("empty-stop-string", lambda i: req(stop=["end", ""]), "stop[1]"),
    ("stop-string-too-long", lambda i: req(stop=["x" * 257]), "stop[0]"),
    ("request-id-empty", lambda i: req(request_id=""), "request_id"),
    ("request-id-too-long", lambda i: req(request_id="r" * 129), "request_id"),
    ("request-id-unprintable", lambda i: req(request_id="a\tb"), "request_id"),
]


@pytest.fixture
async def info(cluster: E2ECluster) -> Info:
    async with gateway_stub(cluster.gateway_address) as stub:
        return await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=10)


async def test_model_info_describes_the_tiny_model(info: Info) -> None:
    assert (info.vocab_size, info.max_model_len) == (49152, 1024)
    assert info.has_chat_template and info.max_logprobs > 0


@pytest.mark.parametrize(("build", "field"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
async def test_bad_request_is_refused_naming_its_field(
    cluster: E2ECluster,
    info: Info,
    build: Callable[[Info], generate_pb2.GenerateRequest],
    field: str,
) -> None:
    async with gateway_stub(cluster.gateway_address) as stub:
        outcome = await generate(stub, build(info), timeout=30)
    assert outcome.code is INVALID, str(outcome)
    assert outcome.details.startswith(field), str(outcome)
    assert not outcome.responses, str(outcome)


async def test_request_id_in_use_is_refused_without_harming_its_owner(
    cluster: E2ECluster,
) -> None:
    async with gateway_stub(cluster.gateway_address) as stub:
        owner = asyncio.ensure_future(
            generate(
                stub, ids_request(20, "owner", max_tokens=600, request_id="same-id"), timeout=60
            )
        )
        await asyncio.sleep(0.2)
        assert not owner.done(), str(owner.result())
        clash = await generate(stub, ids_request(20, "clash", max_tokens=4, request_id="same-id"))
        assert clash.code is INVALID, str(clash)
        assert "request_id" in clash.details, str(clash)
        assert_completed(await owner, 600, cluster.logs())


async def test_max_tokens_past_max_model_len_stops_at_the_limit(
    cluster: E2ECluster, info: Info
) -> None:
    prompt = info.max_model_len - 10
    async with gateway_stub(cluster.gateway_address) as stub:
        outcome = await generate(stub, ids_request(prompt, "near-limit", max_tokens=100))
    assert outcome.code is grpc.StatusCode.OK, str(outcome)
    assert outcome.finish_reason == common_pb2.FINISH_REASON_LENGTH, str(outcome)
    assert outcome.num_tokens == 10, str(outcome)
    usage = outcome.responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, 10)


async def test_a_valid_request_still_succeeds_and_nothing_leaked(cluster: E2ECluster) -> None:
    """Runs last: after every refusal above, the worker serves and holds no block."""
    async with gateway_stub(cluster.gateway_address) as stub:
        outcome = await generate(
            stub,
            req(
                text="Once upon a time",
                sampling_params=sp(max_tokens=12, temperature=0, ignore_eos=True),
            ),
        )
        chatted = await generate(
            stub,
            req(
                chat=chat(("user", "Hi!")),
                sampling_params=sp(max_tokens=5, ignore_eos=True, logprobs=2),
            ),
        )
    assert_completed(outcome, 12, cluster.logs())
    assert "".join(r.text for r in outcome.responses), str(outcome)
    assert_completed(chatted, 5, cluster.logs())
    assert sum(len(r.logprobs) for r in chatted.responses) == 5
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
