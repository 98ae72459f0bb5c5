"""The PrefillWorker service: wiring only.

One bidirectional ``Prefill`` stream per request; the hand-off itself (prefill into the
decode worker's leased blocks, progress beats, transfer, ack) runs in
``prefill_service.handoff``. Stats come from the engine's published snapshot; if the
engine thread dies the worker reports NOT_SERVING for good (``fatal``), and while the
engine is stuck in a step past ``--engine-stall-timeout-s`` until it steps again
(``stalled``, ``rpc.liveness``). The stream's
``traceparent`` (decode's ``decode.wait_kv``) is the parent of the request's spans here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.errors import UnavailableError
from engine.timeline import OFF, Timeline, TimelineRecorder
from engine.transfer.base import TransferConfig
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.handoff import Ack
from prefill_service.handoff import PrefillHandoff, PrefillLimits
from prefill_service.kv_outbox import KVOutbox
from protos.baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.convert import worker_stats_to_proto
from rpc.convert_handoff import ack_from_proto, prefill_event_to_proto, prefill_order_from_proto
from rpc.kv_events import kv_event_stream
from rpc.liveness import EngineStall
from rpc.tracing import context_from_metadata
from rpc.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    """``fleet_key``: the fleet's shared secret (read once in ``__main__``): orders must
    carry its tag, and the rendezvous store and transfer reports carry ours.
    ``tracer_provider``: built in ``__main__`` (None: no spans)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        *,
        fleet_key: FleetKey | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ):
        assert cfg.role == "prefill"
        self.cfg = cfg
        provider = tracer_provider or trace.NoOpTracerProvider()
        self._tracer = provider.get_tracer("baton.prefill")
        # The engine loop's and the KV sender's spans, written on close (--timeline-file).
        self.timeline: TimelineRecorder = Timeline("prefill") if cfg.timeline_file else OFF
        self._fleet_key = fleet_key
        self.engine: AsyncEngine | None = None
        self.outbox: KVOutbox | None = None
        self.handoff: PrefillHandoff | None = None
        self._incarnation = uuid.uuid4().hex
        self._fatal: asyncio.Future[str] | None = None
        self._stall = EngineStall(
            cfg.engine_stall_timeout_s,
            lambda: self.engine.snapshot_age_s if self.engine is not None else None,
        )

    async def start(self) -> None:
        """Readiness: load weights, allocate KV, warm up, start the transfer worker."""
        loop = asyncio.get_running_loop()
        self._fatal = loop.create_future()
        core = await asyncio.to_thread(EngineCore, self.cfg.engine, show_progress=False)
        await asyncio.to_thread(core.warm_up)
        self.engine = AsyncEngine(core, on_death=self._engine_died, timeline=self.timeline)
        await self.engine.start()
        self.outbox = KVOutbox(
            self.cfg.transport,
            core.runner.kv_cache,
            core.layout,
            loop,
            TransferConfig(fleet_key=self._fleet_key),
            timeline=self.timeline,
        )
        limits = PrefillLimits(stall_s=self.cfg.transfer_timeout_s)
        self.handoff = PrefillHandoff(
            self.engine, self.outbox, core.layout, limits, self._fleet_key, self._tracer
        )
        logger.info("prefill worker ready (incarnation %s)", self._incarnation)

    async def fatal(self) -> str:
        """Resolves (with the reason) once this worker can no longer serve."""
        assert self._fatal is not None, "start() first"
        return await asyncio.shield(self._fatal)

    def stalled(self) -> str | None:
        """Why this worker cannot serve for now (its engine is stuck in a step), or None."""
        return self._stall.check()

    async def close(self) -> None:
        if self.handoff is not None:
            await self.handoff.close(self.cfg.transfer_timeout_s)
        if self.outbox is not None:
            await asyncio.to_thread(self.outbox.close)
        if self.engine is not None:
            await self.engine.shutdown()
        if isinstance(self.timeline, Timeline) and self.cfg.timeline_file is not None:
            await asyncio.to_thread(self.timeline.write, self.cfg.timeline_file)
            logger.info("engine timeline written to %s", self.cfg.timeline_file)

    def _engine_died(self, exc: BaseException) -> None:
        logger.error("prefill engine died: %r; reporting NOT_SERVING", exc)
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_result(f"engine thread died: {exc!r}")

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        engine = self._engine()
        return worker_stats_to_proto(
            "prefill",
            self._incarnation,
            engine.stats(),
            engine.busy_fraction(),
            engine.core.layout,
        )

    async def KVEvents(
        self, request: worker_pb2.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KVEventBatch]:
        core = self._engine().core
        async for batch in kv_event_stream(core.kv_events, core.layout.block_size):
            yield batch

    async def Prefill(
        self,
        request_iterator: AsyncIterator[worker_pb2.PrefillClientMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.PrefillServerMessage]:
        self._engine()
        assert self.handoff is not None
        incoming = aiter(request_iterator)
        order = prefill_order_from_proto(
            await anext(incoming, None), self._engine().core.max_model_len
        )
        acks = _acks(incoming)
        parent = context_from_metadata(context.invocation_metadata())
        events = self.handoff.run(order, acks, context.time_remaining(), trace_context=parent)
        async with contextlib.aclosing(events):
            async for event in events:
                yield prefill_event_to_proto(order.request_id, event)

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise UnavailableError("prefill worker is still starting")
        return self.engine


async def _acks(
    incoming: AsyncIterator[worker_pb2.PrefillClientMessage],
) -> AsyncIterator[Ack | None]:
    async for msg in incoming:
        yield ack_from_proto(msg)
