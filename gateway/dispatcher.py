"""One request's ``Decode`` call, with retries before its first token.

The dispatcher picks a route, opens ``DecodeWorker.Decode`` with what is left of the
client's deadline, and yields the decode worker's outputs. An attempt that fails with
UNAVAILABLE or ABORTED *before any token arrived* is retried, up to ``max_retries`` times:
on another prefill worker when there is one, and on another decode worker when a fresh
``Stats`` gets no serving answer from the failed one. A request that finds no worker up
waits briefly for one (``Router.route``). Once a token has reached the caller a failure is
final, and surfaces with the same status code. RESOURCE_EXHAUSTED before the first token
is retried on another worker *of the role that ran out*, one that has not refused this
request: the decode worker relays a prefill worker's full queue as RESOURCE_EXHAUSTED
naming the prefill role (``rpc.errors.RoleExhaustedError``, carried in the trailing
metadata), and the retry goes to another prefill worker, the decode worker staying
eligible (with one decode worker, the same one); without that role the decode worker
itself had no room (its reservation queue was full), and the retry goes to another decode worker. When every worker of that role that is up has
refused, the error surfaces. Other codes (INVALID_ARGUMENT, DEADLINE_EXCEEDED, ...) pass
through at once, with the worker's message.

Closing the stream (the caller saw a stop string, or went away) cancels the ``Decode``
call, which makes decode abort the request and free its blocks, and prefill's.

Each attempt's routing decision is a ``gateway.route`` span under the job's trace context,
and that context travels to decode in the ``Decode`` call's metadata (``traceparent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
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
from gateway.router import Router
from gateway.workers import Route, WorkerKind
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


class Dispatcher:
    """Runs :class:`DecodeJob`s on the workers the router picks. One per gateway."""

    def __init__(
        self,
        router: Router,
        channels: ChannelCache,
        *,
        max_retries: int,
        tracer: trace.Tracer | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self._router = router
        self._channels = channels
        self._max_attempts = 1 + max_retries
        self._tracer = tracer or trace.NoOpTracer()

    def check_room(self, admitted: int) -> None:
        """Raise ResourceExhaustedError when the decode workers that are up have no room
        for one more of this gateway's ``admitted`` requests (``Router.check_room``)."""
        self._router.check_room(admitted)

    async def stream(
        self, job: DecodeJob, *, timeout: float | None
    ) -> AsyncGenerator[RequestOutput, None]:
        """The decode outputs of ``job``, the last one finished.

        ``timeout`` (seconds; None: no deadline) bounds every attempt together. Raises the
        typed error of the last failure (UnavailableError, AbortedError, ValueError, ...).
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        request = worker_pb2.DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            sampling_params=sampling_params_to_proto(job.params),
        )
        failed_prefill: list[str] = []
        # Workers that answered RESOURCE_EXHAUSTED to this request, by the role that ran out.
        full_decode: list[str] = []
        full_prefill: list[str] = []
        exhausted: ResourceExhaustedError | None = None
        metadata = metadata_for(job.trace_context)
        failed_decode: list[str] = []
        for attempt in range(1, self._max_attempts + 1):
            with span(
                self._tracer, "gateway.route", job.trace_context, request_id=job.request_id
            ) as route_span:
                route = await self._router.route(
                    len(job.prompt_token_ids),
                    avoid_prefill=[*failed_prefill, *full_prefill],
                    avoid_decode=[*failed_decode, *full_decode],
                    timeout=None if deadline is None else deadline - loop.time(),
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
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceededError(
                    f"request {job.request_id}: deadline passed after {attempt - 1} attempt(s)"
                )
            request.prefill_address = route.prefill
            started = False
            try:
                with self._router.using(route):
                    attempt_outs = self._attempt(route, request, remaining, metadata)
                    async with contextlib.aclosing(attempt_outs) as outs:
                        async for out in outs:
                            started = started or bool(out.new_token_ids) or out.finished
                            yield out
                return
            except (UnavailableError, AbortedError) as exc:
                if started or attempt == self._max_attempts:
                    raise
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
            except ResourceExhaustedError as exc:
                # No room on one of the workers: it is fine, so no probe; try another
                # worker of the role that ran out, keeping the other one.
                if started or attempt == self._max_attempts:
                    raise
                if _prefill_ran_out(exc) and route.prefill:
                    role, address, full = "prefill", route.prefill, full_prefill
                else:
                    role, address, full = "decode", route.decode, full_decode
                full.append(address)
                exhausted = exc
                logger.warning(
                    "request %s: attempt %d/%d: %s worker %s has no room (%s); trying "
                    "another %s worker",
                    job.request_id,
                    attempt,
                    self._max_attempts,
                    role,
                    address,
                    exc,
                    role,
                )

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
                    raise AbortedError(
                        f"request {rid}: the decode stream ended without a finish reason"
                    )
                try:
                    out = output_from_decode_response(rid, msg)
                except ValueError as exc:  # the worker broke the protocol, not the client
                    raise AbortedError(f"request {rid}: malformed DecodeResponse: {exc}") from exc
                if out.finished:
                    # Let the call end on its own, so decode sees a finished request, not a
                    # cancelled one.
                    with contextlib.suppress(TimeoutError, grpc.RpcError):
                        await asyncio.wait_for(call.code(), _STATUS_WAIT_S)
                yield out
                if out.finished:
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
