"""A worker's ``KVEvents`` stream: its engine's ``KVEventLog`` as ``KVEventBatch`` messages.

Both worker services serve it the same way: a snapshot first, then every batch the engine
closes, read off the log every ``poll_s`` (the engine thread never waits on a reader). A
reader that falls behind the log's history gets a fresh snapshot, marked as one, so it
never applies batches across a gap. Ends when the call is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.kv_events import KVEventLog
from protos.baton.v1 import worker_pb2

POLL_S = 0.05


async def kv_event_stream(
    log: KVEventLog, block_size: int, poll_s: float = POLL_S
) -> AsyncIterator[worker_pb2.KVEventBatch]:
    seq: int | None = None
    while True:
        for batch in log.since(seq):
            yield worker_pb2.KVEventBatch(
                seq=batch.seq,
                snapshot=batch.snapshot,
                stored=batch.stored,
                removed=batch.removed,
                block_size=block_size,
            )
            seq = batch.seq
        await asyncio.sleep(poll_s)
