"""The one request path behind both front ends (gRPC ``Baton.Generate`` and OpenAI HTTP).

validate -> admit (at most ``max_streams`` in flight over both front ends; past it
RESOURCE_EXHAUSTED at once) -> tokenize -> dispatch to decode (deadline propagated) ->
detokenize, apply stop strings -> deltas. A front end only maps its wire format onto a
:class:`GenerateInput` (its own validator, run by :meth:`Generation.validate`) and the
resulting :class:`GenerateDelta` s back onto its wire format.

Errors are raised as typed exceptions (ValueError / FieldError, ResourceExhaustedError,
UnavailableError, DeadlineExceededError, ...); each front end maps them in one place
(rpc.errors for gRPC, gateway.http.errors for HTTP). Closing the delta stream early (a
stop string, a client that went away, a passed deadline) closes the dispatch stream,
which cancels the ``Decode`` call downstream and frees the request's blocks everywhere.

Traces: a front end opens the request's root span ``gateway.request``
(:meth:`Generation.request_span`, under the caller's ``traceparent`` if any, else a new
trace); under it come ``gateway.validate``,
``gateway.tokenize`` and ``gateway.stream``, which is the parent of each attempt's
``gateway.route`` and of decode's own spans.

Timings: the last delta carries the request's phases (``RequestTimings``): the ones only
the workers see as they reported them (queued, reserved, prefill, transfer; decode's
first message has them, so they are there even when the gateway ends the request over a
stop string), and ``first_token_s``, ``decode_s`` and ``total_s`` as the client sees
them, measured here from the request's arrival at the gateway (so first token + decode
= total). The gateway logs them with the request's finish, one line per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from opentelemetry import trace
from opentelemetry.context import Context

from engine.errors import DeadlineExceededError, ResourceExhaustedError
from engine.request import RequestTimings
from gateway.metrics import GatewayMetrics, RequestTrack
from gateway.routing.dispatcher import DecodeJob, Dispatcher
from gateway.routing.migration import BrokenStreamError, Move
from gateway.served_model import ModelCard, ServedModel
from gateway.text.output_processor import GenerateDelta, OutputProcessor
from gateway.text.tokenizer import Tokenizer
from gateway.validation import FieldError, GenerateInput, check_prompt_length
from rpc.tracing import REQUEST_ID, child_context, span

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class RequestTrace:
    """One request's root span, and the context its child spans hang under."""

    root: trace.Span
    context: Context
    track: RequestTrack | None = None  # the request's metrics, when the gateway has them
    # When the request arrived (time.monotonic()): where its timings count from.
    began: float = field(default_factory=time.monotonic)


class Generation:
    """Runs requests for the front ends. One per gateway."""

    def __init__(
        self,
        model: ServedModel,
        dispatcher: Dispatcher,
        tracer: trace.Tracer | None = None,
        metrics: GatewayMetrics | None = None,
        *,
        max_streams: int = 1024,
    ) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self._model = model
        self._dispatcher = dispatcher
        self._tracer = tracer or trace.NoOpTracer()
        self._metrics = metrics
        # Ids of requests in flight here (both front ends): a duplicate would make logs,
        # cancellation and usage ambiguous, so it is refused; their number is capped.
        self._in_flight: set[str] = set()
        self.max_streams = max_streams

    @property
    def num_streams(self) -> int:
        """Requests in flight now, gRPC and HTTP together."""
        return len(self._in_flight)

    def check_capacity(self) -> None:
        """Raise ResourceExhaustedError when ``max_streams`` requests are in flight, or
        when every decode worker that is up is full (``Router.check_room``). A
        front end calls it first thing, so a refusal costs next to nothing; ``stream``
        calls it again when the request takes its slot."""
        if len(self._in_flight) >= self.max_streams:
            raise ResourceExhaustedError(
                f"the gateway is at its limit of {self.max_streams} concurrent streams "
                "(--max-concurrent-streams); retry later or on another gateway"
            )
        self._dispatcher.check_room(len(self._in_flight))

    @property
    def card(self) -> ModelCard:
        return self._model.card

    @contextlib.contextmanager
    def request_span(self, api: str, parent: Context) -> Iterator[RequestTrace]:
        """The request's root span, ``gateway.request`` (kind SERVER), under ``parent``
        (the caller's context); ``api`` names the front end and endpoint. Also the
        request's metrics: counted by the status it ends with, whichever front end."""
        track = self._metrics.track() if self._metrics is not None else None
        error: BaseException | None = None
        try:
            with span(self._tracer, "gateway.request", parent, kind=trace.SpanKind.SERVER) as root:
                root.set_attribute("baton.api", api)
                yield RequestTrace(root=root, context=child_context(root), track=track)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if track is not None:
                track.finish(error)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._model.tokenizer

    def validate(
        self,
        check: Callable[[ModelCard], T],
        tr: RequestTrace,
        input_of: Callable[[T], GenerateInput],
    ) -> tuple[T, str]:
        """Run a front end's validator against the served model (span ``gateway.validate``);
        returns what it returned and the request id (the client's, or a new one).
        ``input_of`` picks the :class:`GenerateInput` out of the validator's result."""
        with span(self._tracer, "gateway.validate", tr.context) as s:
            checked = check(self._model.card)
            rid = input_of(checked).request_id or uuid.uuid4().hex
            s.set_attribute(REQUEST_ID, rid)
        tr.root.set_attribute(REQUEST_ID, rid)
        return checked, rid

    async def stream(
        self, req: GenerateInput, rid: str, tr: RequestTrace, *, deadline: float | None
    ) -> AsyncGenerator[GenerateDelta, None]:
        """Deltas with content, then exactly one ``last`` delta (finished, with usage); or a
        typed error. With n > 1 each choice ends with a finished delta, the last of them
        ``last``.

        ``deadline`` is in ``loop.time()`` seconds (None: none). Closing the generator
        early cancels the request downstream.
        """
        # Before any tokenizing: the tokenizer queue and every worker's queue stay
        # bounded by this cap.
        self.check_capacity()
        if rid in self._in_flight:
            raise FieldError(
                "request_id", f"request_id {rid!r} is already in use by a request in flight"
            )
        self._in_flight.add(rid)
        try:
            async for delta in self._stream(req, rid, tr, deadline):
                yield delta
        finally:
            self._in_flight.discard(rid)

    async def _stream(
        self, req: GenerateInput, rid: str, tr: RequestTrace, deadline: float | None
    ) -> AsyncGenerator[GenerateDelta, None]:
        card = self._model.card
        with span(self._tracer, "gateway.tokenize", tr.context, request_id=rid) as s:
            prompt = await self._prompt_token_ids(req)
            s.set_attribute("baton.prompt_tokens", len(prompt))
            check_prompt_length(req.prompt_field, len(prompt), card)
        logger.info(
            "request %s: %d prompt tokens (%s), max_tokens %d, %d stop string(s)",
            rid,
            len(prompt),
            req.prompt_field,
            req.params.max_tokens,
            len(req.stop),
        )
        # One per choice (n > 1: decode's outputs carry their choice's index).
        processors = [
            OutputProcessor(
                rid,
                prompt,
                req.params,
                self._model.tokenizer,
                stop=req.stop,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
            )
            for _ in range(req.params.n)
        ]
        ended: list[GenerateDelta | None] = [None] * req.params.n
        loop = asyncio.get_running_loop()
        final: GenerateDelta | None = None
        reported = RequestTimings()  # what decode said so far
        first_at: float | None = None
        with span(self._tracer, "gateway.stream", tr.context, request_id=rid) as stream_span:
            moves: list[Move] = []

            def on_move(move: Move) -> None:
                moves.append(move)
                if tr.track is not None:
                    tr.track.moved(move.reason)

            job = DecodeJob(
                request_id=rid,
                prompt_token_ids=prompt,
                params=req.params,
                trace_context=child_context(stream_span),
                on_move=on_move,
            )
            timeout = None if deadline is None else deadline - loop.time()
            try:
                if timeout is not None and timeout <= 0:
                    raise DeadlineExceededError(f"request {rid}: deadline passed before dispatch")
                outputs = self._dispatcher.stream(job, timeout=timeout)
                async with contextlib.aclosing(outputs) as outs:
                    async for out in outs:
                        reported = reported.merged(out.timings)
                        if not 0 <= out.index < len(processors):
                            raise BrokenStreamError(
                                f"request {rid}: decode sent choice {out.index} of "
                                f"{len(processors)}"
                            )
                        if ended[out.index] is not None:
                            continue  # a choice a stop string ended: the rest is not shown
                        delta = processors[out.index].process(out)
                        delta.index = out.index
                        if first_at is None and (delta.has_content or delta.finished):
                            first_at = time.monotonic()
                        if delta.finished:
                            ended[out.index] = delta
                            if all(d is not None for d in ended):
                                final = delta  # leaving the loop cancels decode if going
                                break
                            delta.usage = None  # the request's, on its last delta only
                            yield delta
                        elif delta.has_content:
                            if tr.track is not None:
                                tr.track.tokens(len(delta.token_ids))
                            yield delta
            except (asyncio.CancelledError, GeneratorExit):
                past = deadline is not None and loop.time() >= deadline
                why = "its deadline passed" if past else "cancelled"
                logger.info("request %s: ended by the client (%s); decode cancelled", rid, why)
                raise
            except Exception as exc:  # logged with the request id, then mapped by the front end
                logger.info("request %s: failed: %s: %s", rid, type(exc).__name__, exc)
                raise
            assert final is not None, "the dispatch stream ends with a finished output or raises"
            assert first_at is not None
            completion_tokens = sum(p.num_completion_tokens for p in processors)
            stream_span.set_attribute("baton.completion_tokens", completion_tokens)
            stream_span.set_attribute("baton.migrations", len(moves))
        final.timings = _final_timings(reported, tr.began, first_at, time.monotonic())
        final.last = True
        if len(processors) > 1:  # the prompt once, every choice's tokens
            assert final.usage is not None
            final.usage = dataclasses.replace(final.usage, completion_tokens=completion_tokens)
        if moves:
            assert final.usage is not None
            final.usage = dataclasses.replace(final.usage, migrations=len(moves))
        logger.info(
            "request %s: finished (%s) with %d tokens in %.3fs; %s%s",
            rid,
            describe_finish(final),
            completion_tokens,
            final.timings.total_s,
            describe_timings(final.timings),
            f"; moved {len(moves)} time(s)" if moves else "",
        )
        if tr.track is not None:
            tr.track.tokens(len(final.token_ids))
        yield final

    async def _prompt_token_ids(self, req: GenerateInput) -> list[int]:
        if req.text is not None:
            return await self._model.tokenizer.encode(req.text)
        if req.chat is not None:
            return await self._model.tokenizer.apply_chat_template(req.chat)
        assert req.token_ids is not None
        return list(req.token_ids)


def _final_timings(
    reported: RequestTimings, began: float, first_at: float, now: float
) -> RequestTimings:
    """The workers' phases, with first token, decode and total as the gateway saw them."""
    mine = RequestTimings(
        first_token_s=first_at - began, decode_s=now - first_at, total_s=now - began
    )
    return reported.merged(mine)


# The phases of a request's finish log line, in order (``describe_timings``).
LOGGED_PHASES = ("queued", "reserved", "prefill", "transfer", "first_token", "decode")
_LOGGED = re.compile(r"\b(" + "|".join(LOGGED_PHASES) + r")=(-|[0-9.]+s)(?=\s|$)")


def describe_timings(timings: RequestTimings) -> str:
    """``queued=0.002s reserved=0.000s ...``: every phase, ``-`` for an unknown one."""
    parts = []
    for name in LOGGED_PHASES:
        value = getattr(timings, f"{name}_s")
        parts.append(f"{name}={'-' if value is None else f'{value:.3f}s'}")
    return " ".join(parts)


def parse_timings(line: str) -> RequestTimings:
    """The phases of a log line ``describe_timings`` wrote (for tools reading the logs)."""
    found = {f"{k}_s": float(v[:-1]) for k, v in _LOGGED.findall(line) if v != "-"}
    return RequestTimings(**found)


def describe_finish(delta: GenerateDelta) -> str:
    if delta.stop_string is not None:
        return f"stop string {delta.stop_string!r}"
    return delta.finish_reason.value if delta.finish_reason is not None else "unfinished"
