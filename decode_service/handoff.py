"""The decode side of the KV hand-off (``engine.transfer.handoff`` has the message flow).

For one request: reserve blocks on the engine (the backpressure point: a request the pool
cannot take waits in the engine's bounded reservation FIFO until blocks free up, its
deadline passes or it is cancelled; a full FIFO fails it at once with RESOURCE_EXHAUSTED,
which the gateway retries on another decode worker), lease them on the KV inbox, order a
prefill worker to fill them (one whose queue is full refuses with RESOURCE_EXHAUSTED
naming the prefill role, relayed as is, which the gateway retries on another prefill
worker), follow its progress beats (each moves
the lease's deadline), verify the transfer, wait for the lease to end, acknowledge, and
only then let the request run and release its first token. Until that moment a failure
is invisible to the client, so the gateway may retry it elsewhere.

Bounds: the prefill peer may go ``stall_s`` without a message that shows progress; the
client's own deadline bounds everything. A stalled peer ends the request with ABORTED
(retryable); the client's deadline with DEADLINE_EXCEEDED.

Cleanup: a request that fails before its hand-off completes cancels its lease and gives
its blocks back to the engine only once the lease has ended, that is once no peer can
write them any more, however long a stalled writer takes. The transport is reached
through ``PrefillLink``, so this module is tested without gRPC.

Peers: every hand-off stream is counted on ``PrefillPeers`` and its prefill worker's
sender incarnation reported there, which drops what a restarted, moved, departed or idle
prefill worker left behind (its channel, its connections on the KV receiver).

Traces and timings: under the caller's trace context, the spans ``decode.reserve``
(blocks reserved), ``decode.wait_kv`` (the order to the prefill worker until its KV is
verified and acknowledged: the hand-off; the prefill worker's spans hang under it, its
context travelling with the order) and ``decode.decode`` (first token to the stream's
end). The first output carries the hand-off's timings: ``reserved_s`` here, ``queued_s``,
``prefill_s`` and ``transfer_s`` as the prefill worker reported them.

Fleet: with the fleet's secret the order is signed over all its fields, and the stream
goes through ``FleetLink``, which signs the ack and lets no event of the prefill worker
through whose tag does not check (PERMISSION_DENIED).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context

from decode_service.fleet_link import FleetLink
from decode_service.kv_inbox import KVInbox
from decode_service.prefill_peers import PrefillPeers
from engine.async_engine import AsyncEngine, KVLease
from engine.errors import (
    AbortedError,
    DeadlineExceededError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from engine.request import RequestOutput, RequestTimings
from engine.sampling_params import SamplingParams
from engine.transfer.base import RecvCompletion
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import (
    Ack,
    FirstToken,
    PrefillEvent,
    PrefillOrder,
    Progress,
    TransferDone,
    done_is_signed,
    order_tag,
)
from rpc.tracing import child_context, span

logger = logging.getLogger(__name__)

E = TypeVar("E", FirstToken, TransferDone)


class PrefillLink(Protocol):
    """Decode's end of one Prefill stream to one prefill worker.

    ``send`` and ``receive`` raise typed errors (UnavailableError for a lost peer, ...;
    a refusal for lack of room as ``rpc.errors.RoleExhaustedError`` naming the prefill
    role, so it reaches the gateway as the prefill worker's, not this worker's).
    """

    async def send(self, message: PrefillOrder | Ack) -> None: ...

    async def receive(self) -> PrefillEvent | None:
        """The next event; None once the peer ended the stream."""
        ...

    async def done_writing(self) -> None: ...

    def cancel(self) -> None:
        """End the stream now (idempotent); the peer frees what it holds for it."""
        ...


# Opens the stream to the prefill worker at an address; the float is the time left to
# the client's deadline in seconds (None: no deadline), computed when it is called; the
# context is the trace context the stream carries to the prefill worker.
OpenLink = Callable[[str, float | None, Context | None], PrefillLink]


@dataclass(frozen=True, slots=True)
class HandoffLimits:
    # Longest the prefill peer may go without a message that shows progress.
    stall_s: float = 30.0

    def __post_init__(self) -> None:
        if self.stall_s <= 0:
            raise ValueError(f"stall_s must be > 0, got {self.stall_s}")


class DecodeHandoff:
    """Runs the hand-off of every request on one decode worker."""

    def __init__(
        self,
        engine: AsyncEngine,
        inbox: KVInbox,
        limits: HandoffLimits,
        open_link: OpenLink,
        fleet_key: FleetKey | None = None,
        tracer: trace.Tracer | None = None,
        peers: PrefillPeers | None = None,
    ) -> None:
        self._engine = engine
        self._tracer = tracer or trace.NoOpTracer()
        self._inbox = inbox
        self._limits = limits
        self._open_link = open_link
        # With a key, the order and ack are signed and every event must carry the fleet's tag.
        self._fleet_key = fleet_key
        # The prefill workers dialled, by address and by sender incarnation.
        self._peers = peers if peers is not None else PrefillPeers(inbox.forget_sender)
        self._cleanups: set[asyncio.Task[None]] = set()

    async def run(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        prefill: str,
        deadline: float | None,
        *,
        trace_context: Context | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, starting with the first token; ``deadline`` is the
        client's, as ``time.monotonic()`` (None: none); ``trace_context`` the caller's
        (the parent of this request's spans). Closing the iterator early cancels the
        hand-off and frees everything."""
        began = time.monotonic()
        with span(self._tracer, "decode.reserve", trace_context, request_id=request_id) as s:
            lease, stream = await self._reserve(request_id, prompt, params, deadline)
            s.set_attribute("baton.kv_blocks", len(lease.block_ids))
        timings = RequestTimings(reserved_s=time.monotonic() - began)
        lease_ended: asyncio.Future[RecvCompletion] | None = None
        link: PrefillLink | None = None
        handed_over = False
        self._peers.begin(prefill)
        try:
            with span(
                self._tracer, "decode.wait_kv", trace_context, request_id=request_id
            ) as wait_span:
                wait_span.set_attribute("baton.prefill", prefill)
                desc, lease_ended = self._inbox.lease(
                    request_id,
                    lease.block_ids,
                    lease.generation,
                    self._limits.stall_s,
                    first_block=lease.first_block,
                )
                # The time left is taken now, after the wait for blocks, not when the
                # request arrived; the order carries it too, signed.
                remaining = _remaining(deadline)
                link = self._open_link(prefill, remaining, child_context(wait_span))
                if self._fleet_key is not None:
                    link = FleetLink(link, self._fleet_key, prefill)
                order = PrefillOrder(request_id, tuple(prompt), params, desc, timeout_s=remaining)
                if self._fleet_key is not None:
                    order = dataclasses.replace(order, mac=order_tag(self._fleet_key, order))
                await link.send(order)
                first = await self._expect(link, FirstToken, request_id, prefill, deadline)
                self._peers.note_sender(prefill, first.sender_incarnation)
                done = await self._expect(link, TransferDone, request_id, prefill, deadline)
                self._check_fleet(request_id, prefill, desc.lease_token, done)
                self._inbox.verify(request_id, done.checksum, done.epoch)
                completion = await self._wait(
                    asyncio.shield(lease_ended), request_id, "verifying the KV", deadline
                )
                await link.send(Ack(completion.ok, "" if completion.ok else str(completion.error)))
                await link.done_writing()
                if not completion.ok:
                    assert completion.error is not None
                    raise completion.error
                self._engine.kv_ready(request_id, first.token_id, lease.generation)
                handed_over = True
            with span(self._tracer, "decode.decode", trace_context, request_id=request_id):
                yield RequestOutput(
                    request_id,
                    [first.token_id],
                    logprobs=[first.logprob] if first.logprob is not None else None,
                    num_prompt_tokens=len(prompt),
                    num_cached_tokens=first.num_cached_tokens,
                    timings=_handoff_timings(timings, done.timings),
                    prompt_logprobs=list(first.prompt_logprobs) or None,
                )
                async for out in stream:
                    yield out
        finally:
            if link is not None:
                link.cancel()
            self._peers.end(prefill)
            if handed_over or lease_ended is None:
                self._engine.discard(request_id)
            else:
                self._inbox.cancel(request_id)
                task = asyncio.create_task(self._discard_after(request_id, lease_ended))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def close(self, timeout_s: float) -> None:
        """Wait (bounded) for the blocks of failed hand-offs to come back."""
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=timeout_s)

    # -- steps ------------------------------------------------------------------------

    async def _reserve(
        self, rid: str, prompt: list[int], params: SamplingParams, deadline: float | None
    ) -> tuple[KVLease, AsyncIterator[RequestOutput]]:
        """Reserve KV blocks; when the pool is full, wait in the engine's reservation FIFO
        (no polling) until blocks free up or the client's deadline passes. A request that
        got a place in the bounded FIFO is served: it is never sent away after a timed
        wait, since the refusal would then come late and the wait would be lost."""
        try:
            return await self._engine.reserve(rid, prompt, params, timeout_s=_remaining(deadline))
        except ResourceExhaustedError as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"request {rid}: the client's deadline passed while waiting for KV blocks"
                ) from exc
            raise

    async def _expect(
        self,
        link: PrefillLink,
        kind: type[E],
        rid: str,
        prefill: str,
        deadline: float | None,
    ) -> E:
        """The next event of ``kind``, extending the lease on every progress beat."""
        while True:
            event = await self._wait(
                link.receive(), rid, f"{kind.__name__} from {prefill}", deadline
            )
            if event is None:
                raise AbortedError(
                    f"request {rid}: prefill {prefill} ended the stream before {kind.__name__}"
                )
            if isinstance(event, Progress):
                self._inbox.extend(rid, self._limits.stall_s)
                continue
            if not isinstance(event, kind):
                raise AbortedError(
                    f"request {rid}: prefill {prefill} sent {type(event).__name__} where "
                    f"{kind.__name__} was expected"
                )
            return event

    async def _wait(self, awaitable, rid: str, what: str, deadline: float | None):  # noqa: ANN001, ANN202
        """Await with the stall bound, or the client's deadline if that comes first."""
        remaining = _remaining(deadline)
        stall = self._limits.stall_s
        try:
            return await asyncio.wait_for(
                awaitable, stall if remaining is None else min(stall, remaining)
            )
        except TimeoutError:
            if remaining is not None and remaining <= stall:
                raise DeadlineExceededError(
                    f"request {rid}: the client's deadline passed while waiting for {what}"
                ) from None
            raise AbortedError(
                f"request {rid}: no progress for {stall:.1f} s while waiting for {what}; "
                "the prefill worker is stuck or gone"
            ) from None

    def _check_fleet(self, rid: str, prefill: str, lease_token: int, done: TransferDone) -> None:
        key = self._fleet_key
        if key is not None and not done_is_signed(key, rid, lease_token, done):
            raise PermissionDeniedError(
                f"request {rid}: prefill {prefill} reported a transfer without the fleet's "
                "secret; its KV is not used"
            )

    async def _discard_after(self, rid: str, lease_ended: asyncio.Future[RecvCompletion]) -> None:
        """Give the blocks back once the lease has ended, i.e. no peer can write them.

        No time bound on purpose: a stalled but live writer keeps them quarantined (the
        receiver ends the lease when the writer lets go or dies)."""
        await asyncio.shield(lease_ended)
        self._engine.discard(rid)


def _handoff_timings(here: RequestTimings, prefill: RequestTimings | None) -> RequestTimings:
    """Decode's own phases with the ones only the prefill worker knows (and no others:
    it has no say in decode's)."""
    if prefill is None:
        return here
    return dataclasses.replace(
        here,
        queued_s=prefill.queued_s,
        prefill_s=prefill.prefill_s,
        transfer_s=prefill.transfer_s,
    )


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
