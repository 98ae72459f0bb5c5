"""One request's ``Decode`` calls: retries before its first token, moves after it.

The dispatcher picks a route, opens ``DecodeWorker.Decode`` with what is left of the
client's deadline, and yields the decode worker's outputs. An attempt that fails with
UNAVAILABLE or ABORTED *before any token arrived* is retried, up to ``max_retries`` times:
on another prefill worker when there is one, and on another decode worker when a fresh
``Stats`` gets no serving answer from the failed one. A request that finds no worker up
waits briefly for one (``Router.route``). RESOURCE_EXHAUSTED before the first token is
retried on another worker *of the role that ran out*, one that has not refused this
request: the decode worker relays a prefill worker's full queue as RESOURCE_EXHAUSTED
naming the prefill role (``rpc.errors.RoleExhaustedError``, carried in the trailing
metadata), and the retry goes to another prefill worker, the decode worker staying
eligible (with one decode worker, the same one); without that role the decode worker
itself had no room (its reservation queue was full), and the retry goes to another
decode worker. When every worker of that role that is up has refused, the error
surfaces. Other codes (INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...) pass through at once,
with the worker's message.

Once tokens have reached the caller, a failure that means the decode worker is gone or
leaving *moves* the request (``gateway.routing.migration``): a new ``Decode`` on another decode
worker resumes it from the last token the caller has, up to ``max_migrations`` times per
request; the caller's stream goes on with no gap and no duplicate (with n > 1 choices,
each unfinished choice goes on as its own stream: gateway.routing.choice_moves). Past the bound,
or on any other failure, the request ends with the failure's status (UNAVAILABLE naming the
bound for the former). Each move is one warning line, a ``baton.migration`` event on the
next attempt's ``gateway.route`` span, and a call to ``DecodeJob.on_move``.

Closing the stream (the caller saw a stop string, or went away) cancels the ``Decode``
call, which makes decode abort the request and free its blocks, and prefill's.

Each attempt's routing decision is a ``gateway.route`` span under the job's trace context,
and that context travels to decode in the ``Decode`` call's metadata (``traceparent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.context import Context

from engine.errors import (
    AbortedError,
    DeadlineExceededError,
    ResourceExhaustedError,
    UnavailableError,
)
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from gateway.routing.choice_moves import ChoicesProgress, choice_request_id, merge_choices
from gateway.routing.migration import BrokenStreamError, Move, StreamProgress, move_reason
from gateway.routing.router import Router
from gateway.routing.workers import Route, WorkerKind
from protos.baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.channels import ChannelCache
from rpc.convert import output_from_decode_response, sampling_params_to_proto
from rpc.errors import RoleExhaustedError, error_from_rpc
from rpc.tracing import metadata_for, span

logger = logging.getLogger(__name__)

# How long to wait for a finished call's status before cancelling it anyway.
_STATUS_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class DecodeJob:
    """What the gateway asks decode to generate."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    trace_context: Context | None = None  # the parent of this job's spans and of decode's
    # Called once per move of the request to another decode worker (metric, usage).
    on_move: Callable[[Move], None] | None = None


@dataclass(frozen=True, slots=True)
class Resumption:
    """Where a moved choice of an n > 1 request continues from (gateway.routing.choice_moves)."""

    progress: StreamProgress  # its tokens so far, its moves so far
    moved: Move | None  # the move to report with its first route (once per request)
    left_behind: tuple[str, ...]  # decode workers the request's stream failed on


class Dispatcher:
    """Runs :class:`DecodeJob`s on the workers the router picks. One per gateway."""

    def __init__(
        self,
        router: Router,
        channels: ChannelCache,
        *,
        max_retries: int,
        max_migrations: int = 3,
        tracer: trace.Tracer | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        self._max_migrations = max_migrations
        self._router = router
        self._channels = channels
        self._max_attempts = 1 + max_retries
        self._tracer = tracer or trace.NoOpTracer()

    def check_room(self, admitted: int) -> None:
        """Raise ResourceExhaustedError when the decode workers that are up have no room
        for one more of this gateway's ``admitted`` requests (``Router.check_room``)."""
        self._router.check_room(admitted)

    async def stream(
        self, job: DecodeJob, *, timeout: float | None, resume: Resumption | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """The decode outputs of ``job``, the last one finished.

        ``timeout`` (seconds; None: no deadline) bounds every attempt and move together.
        Raises the typed error of the last failure (UnavailableError, AbortedError,
        ValueError, ...). ``resume``: the job continues a moved choice of an n > 1
        request (gateway.routing.choice_moves).
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        progress = StreamProgress(job.prompt_token_ids, job.params)
        # Per choice, for a move of an n > 1 request.
        choices = ChoicesProgress(job.params.n) if job.params.n > 1 else None
        failed_prefill: list[str] = []
        # Workers that answered RESOURCE_EXHAUSTED to this request, by the role that ran out.
        full_decode: list[str] = []
        full_prefill: list[str] = []
        exhausted: ResourceExhaustedError | None = None
        metadata = metadata_for(job.trace_context)
        failed_decode: list[str] = []
        left_behind: list[str] = []  # decode workers a stream of this request failed on
        attempt = 0
        moved: Move | None = None  # the move the next attempt makes, if it makes one
        if resume is not None:
            progress, moved = resume.progress, resume.moved
            failed_decode += resume.left_behind
            left_behind += resume.left_behind
        while True:
            attempt += 1
            prompt, params = progress.resume()
            with span(
                self._tracer, "gateway.route", job.trace_context, request_id=job.request_id
            ) as route_span:
                route = await self._router.route(
                    len(prompt),
                    avoid_prefill=[*failed_prefill, *full_prefill],
                    avoid_decode=[*failed_decode, *full_decode],
                    timeout=None if deadline is None else deadline - loop.time(),
                    prompt=prompt,
                    # A move never goes back to a worker the stream failed on: a dead one
                    # looks up until its polls go silent long enough, and each retry there
                    # would spend a move in a millisecond. The route waits for another.
                    exclude_decode=left_behind,
                )
                if route.decode in full_decode or (route.prefill and route.prefill in full_prefill):
                    # Every worker of that role that is up said it has no room; asking one
                    # again would only be refused again.
                    assert exhausted is not None
                    raise exhausted
                route_span.set_attribute("baton.attempt", attempt)
                route_span.set_attribute("baton.decode", route.decode)
                if route.prefill:
                    route_span.set_attribute("baton.prefill", route.prefill)
                if moved is not None:
                    self._report_move(job, moved, route, route_span)
                    moved = None
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceededError(
                    f"request {job.request_id}: deadline passed after {attempt - 1} attempt(s)"
                )
            request = worker_pb2.DecodeRequest(
                request_id=job.request_id,
                prompt_token_ids=prompt,
                sampling_params=sampling_params_to_proto(params),
                prefill_address=route.prefill,
            )
            try:
                with self._router.using(route):
                    attempt_outs = self._attempt(route, request, remaining, metadata)
                    async with contextlib.aclosing(attempt_outs) as outs:
                        async for out in outs:
                            self._router.heard_from(route.decode)
                            if choices is not None:
                                choices.record(out)
                            yield progress.record(out)
                return
            except (UnavailableError, AbortedError, ResourceExhaustedError) as exc:
                if progress.started:
                    moved = self._move_or_raise(job, progress, route, exc)
                    # The prompt's part went well: only the decode worker is left behind.
                    # Probing it lets the router see it down for every other request too.
                    failed_decode.append(route.decode)
                    left_behind.append(route.decode)
                    await self._probe(Route(decode=route.decode, prefill=""))
                    if choices is not None:
                        left = None if deadline is None else deadline - loop.time()
                        moving = self._move_choices(
                            job, choices, progress, moved, left_behind, left
                        )
                        async with contextlib.aclosing(merge_choices(moving)) as outs:
                            async for out in outs:
                                yield out
                        return
                    continue
                if attempt >= self._max_attempts:
                    raise
                if isinstance(exc, ResourceExhaustedError):
                    exhausted = exc
                    self._note_full(job, attempt, route, exc, full_decode, full_prefill)
                    continue
                logger.warning(
                    "request %s: attempt %d/%d on decode %s prefill %s failed before its "
                    "first token (%s: %s); retrying",
                    job.request_id,
                    attempt,
                    self._max_attempts,
                    route.decode,
                    route.prefill or "-",
                    type(exc).__name__,
                    exc,
                )
                if route.prefill:
                    failed_prefill.append(route.prefill)
                if not await self._probe(route):
                    failed_decode.append(route.decode)

    def _note_full(
        self,
        job: DecodeJob,
        attempt: int,
        route: Route,
        exc: ResourceExhaustedError,
        full_decode: list[str],
        full_prefill: list[str],
    ) -> None:
        """A worker had no room: it is fine, so no probe; the next attempt tries another
        worker of the role that ran out, keeping the other one."""
        if _prefill_ran_out(exc) and route.prefill:
            role, address, full = "prefill", route.prefill, full_prefill
        else:
            role, address, full = "decode", route.decode, full_decode
        full.append(address)
        logger.warning(
            "request %s: attempt %d/%d: %s worker %s has no room (%s); trying another %s worker",
            job.request_id,
            attempt,
            self._max_attempts,
            role,
            address,
            exc,
            role,
        )

    def _move_choices(
        self,
        job: DecodeJob,
        choices: ChoicesProgress,
        progress: StreamProgress,
        move: Move,
        left_behind: Sequence[str],
        timeout: float | None,
    ) -> dict[int, AsyncGenerator[RequestOutput, None]]:
        """Each unfinished choice of an n > 1 request, continued as its own stream
        (gateway.routing.choice_moves); the move is reported once, with the first of them."""
        streams = {}
        resumes = choices.resumes(list(job.prompt_token_ids), job.params, progress.moves)
        for k, (i, resumed) in enumerate(resumes.items()):
            sub = dataclasses.replace(
                job, request_id=choice_request_id(job.request_id, i), params=job.params.choice(i)
            )
            resume = Resumption(resumed, move if k == 0 else None, tuple(left_behind))
            streams[i] = self.stream(sub, timeout=timeout, resume=resume)
        return streams

    def _move_or_raise(
        self, job: DecodeJob, progress: StreamProgress, route: Route, exc: Exception
    ) -> Move:
        """The move that continues a request whose stream failed after tokens reached the
        caller; raises when the failure ends the request (its kind, or the bound)."""
        reason = move_reason(exc)
        if reason is None:
            raise exc
        if progress.moves >= self._max_migrations:
            bound = (
                "moving requests is off (--max-migrations 0)"
                if self._max_migrations == 0
                else f"it already moved {progress.moves} time(s), the most --max-migrations "
                f"({self._max_migrations}) allows"
            )
            raise UnavailableError(
                f"request {job.request_id}: decode worker {route.decode} failed after "
                f"{len(progress.emitted)} token(s) ({reason.value}: {exc}) and the request "
                f"cannot move: {bound}"
            ) from exc
        progress.moves += 1
        return Move(
            reason=reason,
            source=route.decode,
            number=progress.moves,
            emitted=len(progress.emitted),
            error=f"{type(exc).__name__}: {exc}",
        )

    def _report_move(
        self, job: DecodeJob, move: Move, route: Route, route_span: trace.Span
    ) -> None:
        """One log line, a span event and the job's callback (metric, usage) per move."""
        logger.warning(
            "request %s: moved from decode %s to decode %s after %d token(s) (%s, move %d/%d): %s",
            job.request_id,
            move.source,
            route.decode,
            move.emitted,
            move.reason.value,
            move.number,
            self._max_migrations,
            move.error,
        )
        route_span.add_event(
            "baton.migration",
            {
                "baton.migration.reason": move.reason.value,
                "baton.migration.from": move.source,
                "baton.migration.to": route.decode,
                "baton.migration.emitted_tokens": move.emitted,
                "baton.migration.number": move.number,
            },
        )
        if job.on_move is not None:
            job.on_move(move)

    async def _attempt(
        self,
        route: Route,
        request: worker_pb2.DecodeRequest,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...],
    ) -> AsyncGenerator[RequestOutput, None]:
        rid = request.request_id
        stub = worker_pb2_grpc.DecodeWorkerStub(self._channels.get(route.decode))
        call = stub.Decode(request, timeout=timeout, metadata=metadata or None)
        logger.debug("request %s: Decode on %s (prefill %s)", rid, route.decode, route.prefill)
        # Choices still running (SamplingParameters.n): each ends with a finished message.
        unfinished = max(1, request.sampling_params.n)
        try:
            while True:
                try:
                    msg = await call.read()
                except grpc.aio.AioRpcError as err:
                    logger.info(
                        "request %s: Decode on %s failed: %s: %s",
                        rid,
                        route.decode,
                        err.code().name,
                        err.details(),
                    )
                    raise error_from_rpc(err) from err
                if msg is grpc.aio.EOF:
                    raise BrokenStreamError(
                        f"request {rid}: the decode stream ended without a finish reason"
                    )
                try:
                    out = output_from_decode_response(rid, msg)
                except ValueError as exc:  # the worker broke the protocol, not the client
                    raise BrokenStreamError(
                        f"request {rid}: malformed DecodeResponse: {exc}"
                    ) from exc
                if out.finished:
                    unfinished -= 1
                if not unfinished:
                    # Let the call end on its own, so decode sees a finished request, not a
                    # cancelled one.
                    with contextlib.suppress(TimeoutError, grpc.RpcError):
                        await asyncio.wait_for(call.code(), _STATUS_WAIT_S)
                yield out
                if not unfinished:
                    return
        finally:
            if call.cancel():
                logger.info("request %s: cancelled the Decode call on %s", rid, route.decode)

    async def _probe(self, route: Route) -> bool:
        """Refresh the health of the workers a failed attempt used; True when the decode
        worker answered as serving (the retry moves off it otherwise)."""
        probes = [self._router.probe(route.decode, WorkerKind.DECODE)]
        if route.prefill:
            probes.append(self._router.probe(route.prefill, WorkerKind.PREFILL))
        answered = await asyncio.gather(*probes, return_exceptions=True)
        return answered[0] is True


def _prefill_ran_out(exc: ResourceExhaustedError) -> bool:
    """True when the decode worker relayed its prefill worker's refusal; any other
    RESOURCE_EXHAUSTED from a ``Decode`` call is the decode worker's own."""
    return isinstance(exc, RoleExhaustedError) and exc.role == worker_pb2.WORKER_ROLE_PREFILL
