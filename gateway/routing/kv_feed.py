"""Keeps the gateway's :class:`~gateway.routing.kv_index.KVIndex` fed: one ``KVEvents`` stream per
worker the router knows.

A stream starts with a snapshot and then brings each engine batch. A gap in the sequence
(the worker's history overflowed, or a message was lost), a broken stream or a restarted
worker drops the worker's entries and subscribes again after ``retry_s``, so routing sees
nothing stale for longer than that. A worker that does not serve ``KVEvents``
(UNIMPLEMENTED: an older build) is left out of cache-aware routing, and routed by load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import grpc.aio

from gateway.routing.kv_index import KVIndex
from gateway.routing.workers import WorkerKind
from protos.baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.channels import ChannelCache

logger = logging.getLogger(__name__)

RETRY_S = 1.0


class KVFeed:
    def __init__(self, index: KVIndex, channels: ChannelCache, *, retry_s: float = RETRY_S) -> None:
        self.index = index
        self._channels = channels
        self._retry_s = retry_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def track(self, address: str, kind: WorkerKind) -> None:
        """Follow ``address``'s KV events until :meth:`untrack`."""
        if address not in self._tasks:
            self._tasks[address] = asyncio.create_task(
                self._follow(address, kind), name=f"kv-events-{address}"
            )

    def untrack(self, address: str) -> None:
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
        self.index.drop(address)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, address: str, kind: WorkerKind) -> None:
        while True:
            try:
                gap = await self._subscribe(address, kind)
            except grpc.aio.AioRpcError as err:
                self.index.drop(address)
                if err.code() is grpc.StatusCode.UNIMPLEMENTED:
                    logger.info(
                        "%s worker %s serves no KV events: routed by load only",
                        kind.value,
                        address,
                    )
                    return
                logger.debug("KV events of %s: %s", address, err.code().name)
            else:
                self.index.drop(address)
                if gap:
                    logger.info(
                        "KV events of %s: a gap in the sequence; subscribing again", address
                    )
                    continue
            await asyncio.sleep(self._retry_s)

    async def _subscribe(self, address: str, kind: WorkerKind) -> bool:
        """Apply one stream's batches; True when it stopped at a gap."""
        channel = self._channels.get(address)
        stub: worker_pb2_grpc.DecodeWorkerStub | worker_pb2_grpc.PrefillWorkerStub
        if kind is WorkerKind.DECODE:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        else:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        call = stub.KVEvents(worker_pb2.KVEventsRequest())
        try:
            async for batch in call:
                if not self.index.apply(
                    address,
                    seq=batch.seq,
                    snapshot=batch.snapshot,
                    stored=batch.stored,
                    removed=batch.removed,
                    block_size=batch.block_size,
                ):
                    return True
        finally:
            call.cancel()
        return False
