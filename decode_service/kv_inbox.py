"""The decode side of the KV hand-off: leases on the receiver and their completions.

Bridges the transport's receiver (its own threads) to asyncio: a lease's completion
resolves a future on the event loop. Blocks of a lease are handed back to the engine
only after its completion arrived, because until then a prefill worker may still be
writing them. If the receiver's worker thread dies (every lease then ends with
UnavailableError), ``on_failure`` is called once, on the loop: the worker must stop
serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from engine.kv_layout import KVLayout
from engine.stats import TransferTally
from engine.timeline import OFF, TimelineRecorder
from engine.transfer.base import KVDescriptor, KVReceiver, RecvCompletion, TransferConfig
from engine.transfer.factory import make_receiver

logger = logging.getLogger(__name__)


class KVInbox:
    def __init__(
        self,
        kind: str,
        address: str,
        transfer: TransferConfig | None = None,
        device: str = "cpu",
        timeline: TimelineRecorder = OFF,
        on_failure: Callable[[BaseException], None] | None = None,
    ):
        self.kind = kind
        self.timeline = timeline  # the receiver's leases and verifies go on it
        self.address = address
        self.device = device  # the engine's device: the pool must live where it computes
        self.transfer = transfer
        self.receiver: KVReceiver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, asyncio.Future[RecvCompletion]] = {}
        # request id -> (when its lease was granted, bytes it covers, bytes not sent
        # because this worker held them), for the tally.
        self._started: dict[str, tuple[float, int, int]] = {}
        self.tally = TransferTally()  # every lease's outcome, for the metrics endpoint
        self._on_failure = on_failure
        self._failure_reported = False

    def allocate_pool(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        """The engine's KV pool, placed where prefill workers can write it.

        Called once, from the thread that builds the engine; the running loop must have
        been bound with ``bind`` before.
        """
        assert self.receiver is None, "pool allocated twice"
        self.receiver = make_receiver(
            self.kind,
            layout,
            num_blocks,
            address=self.address,
            config=self.transfer,
            notify=self._notify,
            device=self.device,
        )
        self.receiver.timeline = self.timeline
        logger.info(
            "KV inbox: %s endpoint %s incarnation %s",
            self.kind,
            self.receiver.endpoint.address,
            self.receiver.incarnation,
        )
        return self.receiver.kv_cache

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def incarnation(self) -> str:
        assert self.receiver is not None
        return self.receiver.incarnation

    def lease(
        self,
        request_id: str,
        block_ids: list[int],
        generation: int,
        timeout_s: float,
        first_block: int = 0,
    ) -> tuple[KVDescriptor, asyncio.Future[RecvCompletion]]:
        """Grant a lease on ``block_ids`` (of pool generation ``generation``, the lease's
        epoch) for ``timeout_s`` unless extended; the future resolves when it ends.
        ``first_block``: the prompt's leading blocks this worker already holds (they are
        not sent; counted as saved)."""
        assert self.receiver is not None and self._loop is not None
        fut: asyncio.Future[RecvCompletion] = self._loop.create_future()
        self._waiters[request_id] = fut
        try:
            desc = self.receiver.expect(
                request_id, tuple(block_ids), generation, time.monotonic() + timeout_s
            )
        except BaseException:
            self._waiters.pop(request_id, None)
            raise
        if first_block:
            desc = dataclasses.replace(desc, first_block=first_block)
        block_bytes = desc.endpoint.layout.block_bytes
        self._started[request_id] = (
            time.monotonic(),
            len(block_ids) * block_bytes,
            first_block * block_bytes,
        )
        return desc, fut

    def verify(self, request_id: str, checksum: int, epoch: int) -> None:
        assert self.receiver is not None
        self.receiver.verify(request_id, checksum, epoch)

    def extend(self, request_id: str, timeout_s: float) -> None:
        """The peer made progress: the lease lives ``timeout_s`` from now."""
        assert self.receiver is not None
        self.receiver.extend(request_id, time.monotonic() + timeout_s)

    def forget_sender(self, sender_incarnation: str) -> None:
        assert self.receiver is not None
        self.receiver.forget_sender(sender_incarnation)

    @property
    def failure(self) -> BaseException | None:
        """What killed the receiver's worker thread (``KVReceiver.failure``); None while
        it runs, or before the pool exists."""
        return self.receiver.failure if self.receiver is not None else None

    @property
    def worker_up(self) -> bool | None:
        """Whether the receiver's worker thread runs (False once it died); None before
        the pool exists."""
        return None if self.receiver is None else self.receiver.failure is None

    @property
    def num_quarantined(self) -> int:
        """Leases whose blocks a stalled live sender still claims."""
        return self.receiver.num_quarantined if self.receiver is not None else 0

    def cancel(self, request_id: str) -> None:
        """End the lease; its future still resolves (with CancelledError) once no peer
        can write the blocks any more."""
        assert self.receiver is not None
        self.receiver.cancel(request_id)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self._drain()

    def _notify(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        assert self.receiver is not None
        for completion in self.receiver.poll():
            started = self._started.pop(completion.request_id, None)
            if started is not None:
                began, num_bytes, saved = started
                self.tally.record(
                    time.monotonic() - began, num_bytes, completion.error, saved_bytes=saved
                )
            fut = self._waiters.pop(completion.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(completion)
        failure = self.receiver.failure
        if failure is not None and not self._failure_reported:
            self._failure_reported = True
            if self._on_failure is not None:
                self._on_failure(failure)
