"""The prefill side of the KV hand-off (``engine.transfer.handoff`` has the message flow).

For one order: check it against this worker (layout, block count), run the prompt in the
engine with its KV held, send the first token, queue the copy on the KV outbox, report
it done, and free the source blocks on decode's ack. While the request waits, prefills
or transfers, a ``Progress`` beat goes out every ``beat_s`` in which the engine stepped
or the sender moved data, so decode bounds a stalled worker, not a long prompt.

Source blocks are freed on the ack, on any failure, or when decode goes away, but never
while the sender may still read them. Tested without gRPC: events come out of ``run``
and acks go in as an async iterator.

With a fleet secret an order runs only when its tag checks, every event going out is
signed, and an ack must be signed too (PERMISSION_DENIED otherwise). The order's
``timeout_s`` (signed) bounds the request as the call's deadline does.

Traces and timings: under the caller's trace context (decode's ``decode.wait_kv``), the
spans ``prefill.queue`` (waiting for the engine's first step of the request),
``prefill.prefill`` (that step to the first token; both measured by the engine thread
and recorded once the first token is out) and ``prefill.transfer`` (the KV copy, queued
on the sender to written). ``TransferDone`` reports the same three phases to decode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context

from engine.async_engine import AsyncEngine
from engine.errors import (
    AbortedError,
    BatonError,
    CancelledError,
    DeadlineExceededError,
    LayoutMismatchError,
    PermissionDeniedError,
)
from engine.kv_layout import KVLayout
from engine.request import FinishReason, RequestOutput, RequestTimings
from engine.transfer.base import SendCompletion
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import (
    Ack,
    FirstToken,
    HandoffMessage,
    Phase,
    PrefillEvent,
    PrefillOrder,
    Progress,
    TransferDone,
    message_is_signed,
    message_tag,
    order_is_signed,
)
from prefill_service.kv_outbox import KVOutbox
from rpc.tracing import record_span, span

logger = logging.getLogger(__name__)

_E = TypeVar("_E", bound=HandoffMessage)


@dataclass(frozen=True, slots=True)
class PrefillLimits:
    # Longest decode may take to acknowledge, and the send job's bound without a deadline.
    stall_s: float = 30.0
    # How often a progress beat may go out (only when there was progress).
    beat_s: float = 1.0

    def __post_init__(self) -> None:
        if self.stall_s <= 0 or self.beat_s <= 0:
            raise ValueError(f"stall_s and beat_s must be > 0, got {self.stall_s}, {self.beat_s}")


class PrefillHandoff:
    """Runs the hand-off of every request on one prefill worker."""

    def __init__(
        self,
        engine: AsyncEngine,
        outbox: KVOutbox,
        layout: KVLayout,
        limits: PrefillLimits,
        fleet_key: FleetKey | None = None,
        tracer: trace.Tracer | None = None,
    ) -> None:
        self._engine = engine
        self._tracer = tracer or trace.NoOpTracer()
        self._outbox = outbox
        self._layout = layout
        self._limits = limits
        # With a key, an order and an ack must carry the fleet's tag, and every event ours.
        self._fleet_key = fleet_key
        self._cleanups: set[asyncio.Task[None]] = set()
        # Hand-offs started and not yet acknowledged or failed (SIGTERM waits for them).
        self.in_flight = 0

    async def run(
        self,
        order: PrefillOrder,
        acks: AsyncIterator[Ack | None],
        remaining: float | None,
        *,
        trace_context: Context | None = None,
    ) -> AsyncIterator[PrefillEvent]:
        """The events to send decode. ``acks`` yields decode's messages after the order
        (None or exhaustion: it left); ``remaining``: seconds to the caller's deadline;
        ``trace_context``: the caller's (the parent of this request's spans)."""
        rid = order.request_id
        clock = _SpanClock()
        self._check(order)
        if order.timeout_s is not None:  # decode's signed bound, when it is the sooner
            remaining = order.timeout_s if remaining is None else min(remaining, order.timeout_s)
        # Absolute, so that the prefill's own time counts against the copy's budget.
        deadline = None if remaining is None else time.monotonic() + remaining
        # Only the first token is sampled here; min_tokens still bars an immediate EOS.
        params = dataclasses.replace(
            order.params, max_tokens=1, min_tokens=min(order.params.min_tokens, 1)
        )
        prefill = asyncio.create_task(
            _last(self._engine.generate(rid, list(order.prompt_token_ids), params, hold_kv=True)),
            name=f"prefill-{rid}",
        )
        sent: asyncio.Future[SendCompletion] | None = None
        engine_timings: RequestTimings | None = None
        self.in_flight += 1
        try:
            try:
                async for beat in self._beats(
                    prefill, rid, Phase.PREFILLING, len(order.prompt_token_ids)
                ):
                    yield self._signed(order, beat)
                out = prefill.result()
                if out.finish_reason is FinishReason.ABORT:
                    raise CancelledError(f"request {rid} was aborted during prefill")
            except BaseException as exc:
                self._prefill_spans(trace_context, rid, clock, None, exc)
                raise
            engine_timings = out.timings or RequestTimings()
            self._prefill_spans(trace_context, rid, clock, engine_timings, None)
            assert out.held_block_ids is not None and len(out.new_token_ids) == 1
            first = FirstToken(
                token_id=out.new_token_ids[0],
                logprob=out.logprobs[0] if out.logprobs else None,
                num_cached_tokens=out.num_cached_tokens,
                sender_incarnation=self._outbox.sender.incarnation,
                prompt_logprobs=tuple(out.prompt_logprobs or ()),
            )
            yield self._signed(order, first)
            if deadline is None:
                budget = self._limits.stall_s * 10
            else:
                budget = max(0.0, deadline - time.monotonic())
            with span(self._tracer, "prefill.transfer", trace_context, request_id=rid) as s:
                queued_at = time.monotonic()
                # Decode holds the blocks before first_block already (its prefix cache).
                src = out.held_block_ids[order.descriptor.first_block :]
                sent = self._outbox.send(rid, src, order.descriptor, budget)
                async for beat in self._beats(
                    sent, rid, Phase.TRANSFERRING, len(order.prompt_token_ids)
                ):
                    yield self._signed(order, beat)
                completion = sent.result()
                transfer_s = time.monotonic() - queued_at
                s.set_attribute("baton.kv_bytes", completion.num_bytes)
                if not completion.ok:
                    assert completion.error is not None
                    raise _send_failure(completion.error, remaining, budget)
            assert completion.checksum is not None
            timings = RequestTimings(
                queued_s=engine_timings.queued_s,
                prefill_s=engine_timings.prefill_s,
                transfer_s=transfer_s,
            )
            done = TransferDone(
                completion.checksum, completion.epoch, completion.num_bytes, timings=timings
            )
            yield self._signed(order, done)
            try:
                ack = await asyncio.wait_for(anext(acks, None), self._limits.stall_s)
            except TimeoutError:
                raise AbortedError(
                    f"request {rid}: decode sent no ack within {self._limits.stall_s:.1f} s"
                ) from None
            if ack is None:
                raise AbortedError(f"request {rid}: decode closed the stream without an ack")
            key = self._fleet_key
            if key is not None and not message_is_signed(
                key, rid, order.descriptor.lease_token, ack
            ):
                raise PermissionDeniedError(
                    f"request {rid}: the ack does not carry the fleet's secret; "
                    "only the decode worker that ordered the prefill may acknowledge it"
                )
            if not ack.ok:
                logger.warning("request %s: decode refused the transfer: %s", rid, ack.reason)
        finally:
            self.in_flight -= 1
            if not prefill.done():
                prefill.cancel()  # closing the engine stream aborts the request
            if sent is None or sent.done():
                self._engine.release_held(rid)
            else:
                self._outbox.cancel(rid)
                task = asyncio.create_task(self._release_after(rid, sent))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    def _prefill_spans(
        self,
        parent: Context | None,
        rid: str,
        clock: _SpanClock,
        timings: RequestTimings | None,
        error: BaseException | None,
    ) -> None:
        """``prefill.queue`` and ``prefill.prefill``, from the engine's measurements; a
        request that never got its first token gets one failed ``prefill.prefill``."""
        end = clock.now_ns()
        if timings is None or timings.queued_s is None:
            # No queue/prefill split known: ended (failed, cancelled) before the first token.
            record_span(
                self._tracer,
                "prefill.prefill",
                parent,
                clock.start_ns,
                end,
                request_id=rid,
                error=_failure(error),
            )
            return
        scheduled = clock.start_ns + int(timings.queued_s * 1e9)
        record_span(
            self._tracer, "prefill.queue", parent, clock.start_ns, scheduled, request_id=rid
        )
        record_span(self._tracer, "prefill.prefill", parent, scheduled, end, request_id=rid)

    def _signed(self, order: PrefillOrder, event: _E) -> _E:
        """``event`` with the fleet's tag for ``order``'s lease (as is without a key)."""
        if self._fleet_key is None:
            return event
        tag = message_tag(self._fleet_key, order.request_id, order.descriptor.lease_token, event)
        return dataclasses.replace(event, mac=tag)

    async def close(self, timeout_s: float) -> None:
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=timeout_s)

    def _check(self, order: PrefillOrder) -> None:
        if self._fleet_key is not None and not order_is_signed(self._fleet_key, order):
            raise PermissionDeniedError(
                f"request {order.request_id}: the order does not carry the fleet's secret "
                "(no tag, or one that does not match every field); only decode workers of "
                "this fleet may order a prefill"
            )
        desc = order.descriptor
        mismatch = self._layout.mismatch(desc.endpoint.layout)
        if mismatch:
            raise LayoutMismatchError(f"KV layout of decode worker differs: {mismatch}")
        n, bs = len(order.prompt_token_ids), self._layout.block_size
        if desc.first_block > (n - 1) // bs:
            raise ValueError(
                f"request.kv.first_block is {desc.first_block}; a {n}-token prompt allows at "
                f"most {(n - 1) // bs} (the block of its last token is always sent)"
            )
        need = -(-n // bs) - desc.first_block
        if len(desc.block_ids) != need:
            raise ValueError(
                f"request.kv.block_ids has {len(desc.block_ids)} blocks; a {n}-token prompt "
                f"needs {need} from block {desc.first_block} on"
            )

    async def _beats(
        self, work: asyncio.Future[Any], rid: str, phase: Phase, prompt_len: int
    ) -> AsyncIterator[Progress]:
        """Progress beats until ``work`` is done, one per ``beat_s`` with progress."""
        steps, moved = self._engine.stats().num_steps, self._outbox.progress
        while not work.done():
            await asyncio.wait({work}, timeout=self._limits.beat_s)
            if work.done():
                return
            now_steps, now_moved = self._engine.stats().num_steps, self._outbox.progress
            if (now_steps, now_moved) == (steps, moved):
                continue  # nothing moved: no beat, and decode's bound runs on
            steps, moved = now_steps, now_moved
            if phase is Phase.TRANSFERRING:
                yield Progress(phase, prompt_len)
                continue
            computed = self._engine.computed_tokens(rid)
            yield Progress(Phase.PREFILLING if computed else Phase.QUEUED, computed)

    async def _release_after(self, rid: str, sent: asyncio.Future[SendCompletion]) -> None:
        """Free source blocks once the sender has stopped reading them."""
        began = time.monotonic()
        await asyncio.shield(sent)
        logger.info(
            "request %s: source blocks freed %.2f s after the hand-off ended",
            rid,
            time.monotonic() - began,
        )
        self._engine.release_held(rid)


class _SpanClock:
    """When a request arrived, on the wall clock spans use, and ``time.time_ns()`` of a
    later moment computed from the monotonic clock (immune to wall-clock steps)."""

    __slots__ = ("start_ns", "_start")

    def __init__(self) -> None:
        self.start_ns = time.time_ns()
        self._start = time.monotonic()

    def now_ns(self) -> int:
        return self.start_ns + int((time.monotonic() - self._start) * 1e9)


def _send_failure(error: BatonError, remaining: float | None, budget: float) -> BatonError:
    """A failed send as decode should see it. Without a client deadline the job's
    deadline is only our own budget, and running past it means the transfer stalled:
    ABORTED, which the gateway retries; DEADLINE_EXCEEDED is for the client's deadline."""
    if remaining is None and isinstance(error, DeadlineExceededError):
        return AbortedError(f"the transfer did not finish within {budget:.0f} s: {error}")
    return error


def _failure(error: BaseException | None) -> BaseException | None:
    """The error a span records: a consumer that closed the stream early is none."""
    return None if isinstance(error, GeneratorExit) else error


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    out: RequestOutput | None = None
    async for item in outputs:
        out = item
    assert out is not None and out.finished
    return out
