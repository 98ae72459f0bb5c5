"""The prefill side of the KV hand-off: send jobs on the transport and their completions.

Bridges the transport's sender (its own worker thread) to asyncio: a job's completion
resolves a future on the event loop. Source blocks stay held by the engine until that
completion, because until then the sender may still read them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from engine.kv_layout import KVLayout
from engine.stats import TransferTally
from engine.timeline import OFF, TimelineRecorder
from engine.transfer.base import KVDescriptor, KVSender, SendCompletion, SendJob, TransferConfig
from engine.transfer.factory import make_sender

logger = logging.getLogger(__name__)


class KVOutbox:
    def __init__(
        self,
        kind: str,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        loop: asyncio.AbstractEventLoop,
        config: TransferConfig | None = None,
        timeline: TimelineRecorder = OFF,
    ):
        self._loop = loop
        self._waiters: dict[str, asyncio.Future[SendCompletion]] = {}
        self._started: dict[str, float] = {}  # request id -> when its send was queued
        self.tally = TransferTally()  # every send's outcome, for the metrics endpoint
        self.sender: KVSender = make_sender(kind, kv_cache, layout, config, notify=self._notify)
        self.sender.timeline = timeline  # its sends on the worker's timeline

    def send(
        self, request_id: str, src_block_ids: list[int], desc: KVDescriptor, timeout_s: float
    ) -> asyncio.Future[SendCompletion]:
        """Queue the copy; the future resolves with the job's completion (never raises)."""
        fut: asyncio.Future[SendCompletion] = self._loop.create_future()
        self._waiters[request_id] = fut
        self._started[request_id] = time.monotonic()
        try:
            self.sender.submit(
                SendJob(request_id, tuple(src_block_ids), desc, time.monotonic() + timeout_s)
            )
        except BaseException:
            self._waiters.pop(request_id, None)
            self._started.pop(request_id, None)
            raise
        return fut

    def cancel(self, request_id: str) -> None:
        self.sender.cancel(request_id)

    @property
    def progress(self) -> int:
        """Grows while the sender moves data (see ``KVSender.progress``)."""
        return self.sender.progress

    def close(self) -> None:
        self.sender.close()
        self._drain()

    def _notify(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        for completion in self.sender.poll():
            began = self._started.pop(completion.request_id, None)
            if began is not None:
                seconds = time.monotonic() - began
                self.tally.record(seconds, completion.num_bytes, completion.error)
            fut = self._waiters.pop(completion.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(completion)
