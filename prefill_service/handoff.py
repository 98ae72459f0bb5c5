"""The prefill side of the KV hand-off (``engine.transfer.handoff`` has the message flow).

For one order: check it against this worker (layout, block count), run the prompt in the
engine with its KV held, send the first token, queue the copy on the KV outbox, report
it done, and free the source blocks on decode's ack. While the request waits, prefills
or transfers, a ``Progress`` beat goes out every ``beat_s`` in which the engine stepped
or the sender moved data, so decode bounds a stalled worker, not a long prompt.

Source blocks are freed on the ack, on any failure, or when decode goes away, but never
while the sender may still read them. Tested without gRPC: events come out of ``run``
and acks go in as an async iterator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.async_engine import AsyncEngine
from engine.errors import (
    AbortedError,
    CancelledError,
    LayoutMismatchError,
    PermissionDeniedError,
)
from engine.kv_layout import KVLayout
from engine.request import FinishReason, RequestOutput
from engine.transfer.base import SendCompletion
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import (
    Ack,
    FirstToken,
    Phase,
    PrefillEvent,
    PrefillOrder,
    Progress,
    TransferDone,
    done_tag,
    order_is_signed,
)
from prefill_service.kv_outbox import KVOutbox

logger = logging.getLogger(__name__)


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
    ) -> None:
        self._engine = engine
        self._outbox = outbox
        self._layout = layout
        self._limits = limits
        # With a key, an order must carry the fleet's tag and TransferDone carries ours.
        self._fleet_key = fleet_key
        self._cleanups: set[asyncio.Task[None]] = set()
        # Hand-offs started and not yet acknowledged or failed (SIGTERM waits for them).
        self.in_flight = 0

    async def run(
        self, order: PrefillOrder, acks: AsyncIterator[Ack | None], remaining: float | None
    ) -> AsyncIterator[PrefillEvent]:
        """The events to send decode. ``acks`` yields decode's messages after the order
        (None or exhaustion: it left); ``remaining``: seconds to the caller's deadline."""
        rid = order.request_id
        self._check(order)
        # Only the first token is sampled here; min_tokens still bars an immediate EOS.
        params = dataclasses.replace(
            order.params, max_tokens=1, min_tokens=min(order.params.min_tokens, 1)
        )
        prefill = asyncio.create_task(
            _last(self._engine.generate(rid, list(order.prompt_token_ids), params, hold_kv=True)),
            name=f"prefill-{rid}",
        )
        sent: asyncio.Future[SendCompletion] | None = None
        self.in_flight += 1
        try:
            async for beat in self._beats(
                prefill, rid, Phase.PREFILLING, len(order.prompt_token_ids)
            ):
                yield beat
            out = prefill.result()
            if out.finish_reason is FinishReason.ABORT:
                raise CancelledError(f"request {rid} was aborted during prefill")
            assert out.held_block_ids is not None and len(out.new_token_ids) == 1
            yield FirstToken(
                token_id=out.new_token_ids[0],
                logprob=out.logprobs[0] if out.logprobs else None,
                num_cached_tokens=out.num_cached_tokens,
                sender_incarnation=self._outbox.sender.incarnation,
            )
            budget = self._limits.stall_s * 10 if remaining is None else remaining
            sent = self._outbox.send(rid, out.held_block_ids, order.descriptor, budget)
            async for beat in self._beats(
                sent, rid, Phase.TRANSFERRING, len(order.prompt_token_ids)
            ):
                yield beat
            completion = sent.result()
            if not completion.ok:
                assert completion.error is not None
                raise completion.error
            assert completion.checksum is not None
            done = TransferDone(completion.checksum, completion.epoch, completion.num_bytes)
            if self._fleet_key is not None:
                tag = done_tag(self._fleet_key, rid, order.descriptor.lease_token, done)
                done = dataclasses.replace(done, mac=tag)
            yield done
            try:
                ack = await asyncio.wait_for(anext(acks, None), self._limits.stall_s)
            except TimeoutError:
                raise AbortedError(
                    f"request {rid}: decode sent no ack within {self._limits.stall_s:.1f} s"
                ) from None
            if ack is None:
                raise AbortedError(f"request {rid}: decode closed the stream without an ack")
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

    async def close(self, timeout_s: float) -> None:
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=timeout_s)

    def _check(self, order: PrefillOrder) -> None:
        if self._fleet_key is not None and not order_is_signed(self._fleet_key, order):
            raise PermissionDeniedError(
                f"request {order.request_id}: the order does not carry the fleet's secret; "
                "only decode workers of this fleet may order a prefill"
            )
        desc = order.descriptor
        mismatch = self._layout.mismatch(desc.endpoint.layout)
        if mismatch:
            raise LayoutMismatchError(f"KV layout of decode worker differs: {mismatch}")
        need = -(-len(order.prompt_token_ids) // self._layout.block_size)
        if len(desc.block_ids) != need:
            raise ValueError(
                f"request.kv.block_ids has {len(desc.block_ids)} blocks; a "
                f"{len(order.prompt_token_ids)}-token prompt needs {need}"
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


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    out: RequestOutput | None = None
    async for item in outputs:
        out = item
    assert out is not None and out.finished
    return out
