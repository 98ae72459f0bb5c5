"""The public ``baton.v1.Baton`` service: thin, as every servicer here.

Generate maps the proto onto the one request path (gateway.generation: validate ->
tokenize -> dispatch -> detokenize, stop strings -> deltas) and the deltas back onto
protos; with tools (gateway.grpc_api.tools) a choice's last message carries its parsed calls.
Errors are raised as typed exceptions and turned into status codes by the one
interceptor (rpc.errors). Being cancelled (the client went away, or its deadline passed)
closes the delta stream, which cancels the ``Decode`` call downstream. A ``traceparent``
in the call's metadata becomes the parent of the request's spans.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc.aio

from gateway.generation import Generation
from gateway.grpc_api.tools import ReplyCalls, tool_call_to_proto, validate_tool_request
from gateway.text.output_processor import GenerateDelta
from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from rpc.convert import (
    finish_reason_to_proto,
    request_timings_to_proto,
    token_logprob_to_proto,
    usage_to_proto,
)
from rpc.tracing import context_from_metadata


class BatonServicer(generate_pb2_grpc.BatonServicer):
    def __init__(self, generation: Generation) -> None:
        self._generation = generation

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        gen = self._generation
        gen.check_capacity()
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        parent = context_from_metadata(context.invocation_metadata())
        with gen.request_span("grpc.Generate", parent) as tr:
            (req, plan), rid = gen.validate(
                lambda card: validate_tool_request(request, card), tr, lambda r: r[0]
            )
            calls = ReplyCalls(plan) if plan is not None else None
            async for delta in gen.stream(req, rid, tr, deadline=deadline):
                msg = _to_proto(rid, delta)
                parsed = calls.add(delta) if calls is not None else None
                if parsed is not None:
                    msg.tool_calls.extend(tool_call_to_proto(c) for c in parsed)
                    msg.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
                yield msg

    async def ModelInfo(  # noqa: N802
        self, request: generate_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ModelInfoResponse:
        card = self._generation.card
        return generate_pb2.ModelInfoResponse(
            model_id=card.model_id,
            vocab_size=card.vocab_size,
            max_model_len=card.max_model_len,
            eos_token_ids=card.eos_token_ids,
            has_chat_template=card.has_chat_template,
            max_logprobs=card.max_logprobs,
        )


def _to_proto(request_id: str, delta: GenerateDelta) -> generate_pb2.GenerateResponse:
    msg = generate_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=[token_logprob_to_proto(lp) for lp in delta.logprobs],
        prompt_logprobs=[token_logprob_to_proto(lp) for lp in delta.prompt_logprobs or ()],
        index=delta.index,
    )
    if delta.stop_string is not None:
        msg.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
    else:
        msg.finish_reason = finish_reason_to_proto(delta.finish_reason)
    if delta.usage is not None:
        usage = delta.usage
        msg.usage.CopyFrom(
            usage_to_proto(
                usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.migrations
            )
        )
    if delta.timings is not None:
        msg.timings.CopyFrom(request_timings_to_proto(delta.timings))
    return msg
