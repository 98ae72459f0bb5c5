"""The OpenAI-compatible HTTP API: a Starlette app over the gateway's one request path.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (non-streaming, or SSE with
``"stream": true``), ``GET /v1/models``. The handlers only map: body -> GenerateInput
(gateway.http.request) -> gateway.generation -> deltas -> OpenAI objects
(gateway.http.response); errors -> status and body in one place (gateway.http.errors).

- **Status before the stream**: a streaming response is held back until the first token
  (or a failure), so refusals that come before it (400, 404, 429 no capacity, 503, 504)
  are real HTTP statuses. A failure after the first token ends the stream with an
  ``{"error": {...}}`` event (and no ``[DONE]``), which the ``openai`` client raises.
- **Disconnects**: a client that goes away, before or during the stream, cancels the
  request, which cancels its ``Decode`` call and frees its KV blocks on every worker.
- **Deadlines**: the ``X-Request-Timeout`` header (seconds), else the gateway's
  ``--http-request-timeout-s``; past it the request ends with 504 (or an error event).
- **Traces**: a ``traceparent`` header is the parent of the request's spans; the response
  carries the request id in ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import DeadlineExceededError, ResourceExhaustedError
from gateway.generation import Generation
from gateway.http.errors import BodyTooLargeError, HttpError, http_error_for
from gateway.http.prompt_only import prompt_only
from gateway.http.request import REQUEST_ID_HEADER, Endpoint, OpenAIRequest, parse_request
from gateway.http.response import SSE_DONE, ResponseBuilder, sse_event
from gateway.text.output_processor import GenerateDelta
from gateway.validation import FieldError
from rpc.tracing import context_from_headers

T = TypeVar("T")

TIMEOUT_HEADER = "X-Request-Timeout"
# Larger than any prompt worth tokenizing (gateway.validation.MAX_CHARS_PER_TOKEN) for
# every model this gateway can serve; a body past it is refused before it is parsed.
MAX_BODY_BYTES = 8 * 1024 * 1024


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


@dataclass(slots=True)
class _Started:
    """The first event of a request: validated, with its id."""

    req: OpenAIRequest
    rid: str


def build_app(generation: Generation, *, request_timeout_s: float = 0.0) -> Starlette:
    """The ASGI app. ``request_timeout_s`` is the deadline of a request that sends no
    ``X-Request-Timeout`` header (0: none)."""
    api = _Api(generation, request_timeout_s)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    error = HttpError(exc.status_code, "invalid_request_error", str(exc.detail))
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


class _Api:
    def __init__(self, generation: Generation, request_timeout_s: float) -> None:
        self._gen = generation
        self._timeout_s = request_timeout_s
        self._created = int(time.time())

    async def models(self, request: Request) -> Response:
        try:
            card = self._gen.card
        except Exception as exc:
            return _error_response(http_error_for(exc))
        model = {
            "id": card.model_id,
            "object": "model",
            "created": self._created,
            "owned_by": "baton",
            "max_model_len": card.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.CHAT)

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        rid: str | None = None
        try:
            self._gen.check_capacity()
            deadline = self._deadline(request)
            raw = await _read_body(request)  # all of it, before anything else may receive()
        except (FieldError, BodyTooLargeError, ResourceExhaustedError) as exc:
            return _error_response(http_error_for(exc))
        events = self._events(request, endpoint, raw, deadline)
        try:
            started = await _watch(request, _next(events), deadline)
            assert isinstance(started, _Started)
            rid = started.rid
            if not started.req.stream:
                body = await _watch(request, self._whole(started, events), deadline)
                return JSONResponse(body, headers={REQUEST_ID_HEADER: rid})
            first = await _watch(request, _next(events), deadline)
        except ClientGone:
            await events.aclose()
            return Response(status_code=499)  # nobody reads it; the access record does
        except Exception as exc:
            await events.aclose()
            return _error_response(http_error_for(exc, rid), rid)
        assert isinstance(first, GenerateDelta)
        return StreamingResponse(
            self._sse(started, first, events),
            media_type="text/event-stream",
            headers={REQUEST_ID_HEADER: rid, "Cache-Control": "no-cache"},
        )

    async def _events(
        self, request: Request, endpoint: Endpoint, raw: bytes, deadline: float | None
    ) -> AsyncGenerator[_Started | GenerateDelta, None]:
        """The request's life on the one request path, inside its root span: first a
        :class:`_Started`, then the deltas."""
        gen = self._gen
        parent = context_from_headers(request.headers)
        with gen.request_span(f"openai.{endpoint.value}", parent) as tr:
            header_rid = request.headers.get(REQUEST_ID_HEADER)
            req, rid = gen.validate(
                lambda card: parse_request(endpoint, _json(raw), card, header_rid),
                tr,
                lambda r: r.input,
            )
            yield _Started(req, rid)
            async for delta in gen.stream(req.input, rid, tr, deadline=deadline):
                yield prompt_only(delta) if req.prompt_only else delta

    async def _whole(
        self, started: _Started, events: AsyncGenerator[_Started | GenerateDelta, None]
    ) -> dict[str, Any]:
        builder = self._builder(started)
        async with contextlib.aclosing(events):
            async for delta in events:
                assert isinstance(delta, GenerateDelta)
                builder.add(delta)
        return builder.response()

    async def _sse(
        self,
        started: _Started,
        first: GenerateDelta,
        events: AsyncGenerator[_Started | GenerateDelta, None],
    ) -> AsyncIterator[bytes]:
        builder = self._builder(started)
        async with contextlib.aclosing(events):
            try:
                delta = first
                while True:
                    for chunk in builder.chunks(delta):
                        yield sse_event(chunk)
                    if delta.last:
                        break
                    nxt = await _next(events)
                    assert isinstance(nxt, GenerateDelta)
                    delta = nxt
                if started.req.include_usage and delta.usage is not None:
                    yield sse_event(builder.usage_chunk(delta.usage))
            except Exception as exc:  # after the first token: an error event ends the stream
                yield sse_event(http_error_for(exc, started.rid).body())
                return
        yield SSE_DONE

    def _builder(self, started: _Started) -> ResponseBuilder:
        tokenizer = self._gen.tokenizer

        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        prompt_text = ""
        if started.req.echo:
            given = started.req.input
            prompt_text = (
                given.text
                if given.text is not None
                else tokenizer.decode(list(given.token_ids or ()), skip_special_tokens=False)
            )
        return ResponseBuilder(
            started.req, started.rid, int(time.time()), token_text, prompt_text=prompt_text
        )

    def _deadline(self, request: Request) -> float | None:
        """The request's deadline in loop time (None: none), from the header or default."""
        raw = request.headers.get(TIMEOUT_HEADER)
        timeout = self._timeout_s or None
        if raw is not None:
            try:
                timeout = float(raw)
            except ValueError:
                timeout = math.nan
            if not math.isfinite(timeout) or timeout <= 0:
                raise FieldError(
                    TIMEOUT_HEADER,
                    f"{TIMEOUT_HEADER} must be a number of seconds > 0, got {raw!r}",
                )
        return None if timeout is None else asyncio.get_running_loop().time() + timeout


def _error_response(error: HttpError, rid: str | None = None) -> Response:
    headers = {REQUEST_ID_HEADER: rid} if rid else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _next(events: AsyncGenerator[T, None]) -> T:
    """The next event; a stream that ends early is a broken promise of gateway.generation."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise RuntimeError("the request's event stream ended before it finished") from None


async def _watch(request: Request, aw: Awaitable[T], deadline: float | None) -> T:
    """Await ``aw`` unless the client disconnects first (ClientGone) or the deadline passes
    (DeadlineExceededError); either way ``aw`` is cancelled, which cancels the request."""
    task = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request))
    loop = asyncio.get_running_loop()
    timeout = None if deadline is None else max(0.0, deadline - loop.time())
    try:
        await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        if gone.done() and not gone.cancelled():
            raise ClientGone()
        raise DeadlineExceededError("the request's deadline passed")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the request body must have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise BodyTooLargeError(f"request body has {length} bytes; at most {MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLargeError(f"request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FieldError("", f"the request body is not valid JSON: {err}") from err
