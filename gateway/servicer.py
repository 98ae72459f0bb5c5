"""The public ``baton.v1.Baton`` service: thin, as every servicer here.

Generate: validate -> tokenize -> dispatch to decode (deadline propagated) -> detokenize,
apply stop strings -> stream deltas. Errors are raised as typed exceptions and turned
into status codes by the one interceptor (rpc.errors). Leaving the stream early (a stop
string) or being cancelled (the client went away, or its deadline passed) closes the
dispatch stream, which cancels the ``Decode`` call downstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc.aio

from gateway.dispatcher import DecodeJob, Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.output_processor import GenerateDelta, OutputProcessor
from gateway.served_model import ServedModel
from gateway.validation import GenerateInput, check_prompt_length, validate_generate_request
from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from rpc.convert import finish_reason_to_proto, token_logprob_to_proto, usage_to_proto

logger = logging.getLogger(__name__)


class BatonServicer(generate_pb2_grpc.BatonServicer):
    def __init__(
        self, model: ServedModel, dispatcher: Dispatcher, metrics: GatewayMetrics | None = None
    ) -> None:
        self._model = model
        self._dispatcher = dispatcher
        self._metrics = metrics
        # Client-chosen ids of requests in flight here: a duplicate would make logs,
        # cancellation and usage ambiguous, so it is refused.
        self._in_flight: set[str] = set()

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        began = time.monotonic()
        track = self._metrics.track(began) if self._metrics is not None else None
        error: BaseException | None = None
        try:
            req = validate_generate_request(request, self._model.card)
            rid = req.request_id or uuid.uuid4().hex
            if rid in self._in_flight:
                raise ValueError(f"request_id {rid!r} is already in use by a request in flight")
            self._in_flight.add(rid)
            try:
                async for response in self._generate(req, rid, began, context):
                    if track is not None:
                        track.tokens(len(response.token_ids))
                    yield response
            finally:
                self._in_flight.discard(rid)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if track is not None:
                track.finish(error)

    async def _generate(
        self, req: GenerateInput, rid: str, began: float, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        card = self._model.card
        prompt = await self._prompt_token_ids(req)
        check_prompt_length(req.prompt_field, len(prompt), card)
        logger.info(
            "request %s: %d prompt tokens (%s), max_tokens %d, %d stop string(s)",
            rid,
            len(prompt),
            req.prompt_field,
            req.params.max_tokens,
            len(req.stop),
        )
        processor = OutputProcessor(
            rid,
            prompt,
            req.params,
            self._model.tokenizer,
            stop=req.stop,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )
        job = DecodeJob(request_id=rid, prompt_token_ids=prompt, params=req.params)
        final: GenerateDelta | None = None
        try:
            outputs = self._dispatcher.stream(job, timeout=context.time_remaining())
            async with contextlib.aclosing(outputs) as outs:
                async for out in outs:
                    delta = processor.process(out)
                    if delta.finished:
                        final = delta  # leaving the loop cancels decode if it is still going
                        break
                    if delta.has_content:
                        yield _to_proto(rid, delta)
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            why = "its deadline passed" if remaining is not None and remaining <= 0 else "cancelled"
            logger.info("request %s: ended by the client (%s); decode cancelled", rid, why)
            raise
        except Exception as exc:  # logged with the request id, then mapped by the interceptor
            logger.info("request %s: failed: %s: %s", rid, type(exc).__name__, exc)
            raise
        assert final is not None, "the dispatch stream ends with a finished output or raises"
        yield _to_proto(rid, final)
        logger.info(
            "request %s: finished (%s) with %d tokens in %.3fs",
            rid,
            _describe_finish(final),
            processor.num_completion_tokens,
            time.monotonic() - began,
        )

    async def ModelInfo(  # noqa: N802
        self, request: generate_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ModelInfoResponse:
        card = self._model.card
        return generate_pb2.ModelInfoResponse(
            model_id=card.model_id,
            vocab_size=card.vocab_size,
            max_model_len=card.max_model_len,
            eos_token_ids=card.eos_token_ids,
            has_chat_template=card.has_chat_template,
            max_logprobs=card.max_logprobs,
        )

    async def _prompt_token_ids(self, req: GenerateInput) -> list[int]:
        if req.text is not None:
            return await self._model.tokenizer.encode(req.text)
        if req.chat is not None:
            return await self._model.tokenizer.apply_chat_template(req.chat)
        assert req.token_ids is not None
        return list(req.token_ids)


def _describe_finish(delta: GenerateDelta) -> str:
    if delta.stop_string is not None:
        return f"stop string {delta.stop_string!r}"
    return delta.finish_reason.value if delta.finish_reason is not None else "unfinished"


def _to_proto(request_id: str, delta: GenerateDelta) -> generate_pb2.GenerateResponse:
    msg = generate_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=[token_logprob_to_proto(lp) for lp in delta.logprobs],
    )
    if delta.stop_string is not None:
        msg.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
    else:
        msg.finish_reason = finish_reason_to_proto(delta.finish_reason)
    if delta.usage is not None:
        usage = delta.usage
        msg.usage.CopyFrom(
            usage_to_proto(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        )
    return msg
