"""The PrefillWorker service: prompt pass into a decode worker's leased blocks.

One bidirectional stream per request. Decode sends the request with its KV descriptor;
this worker runs the prompt in its own continuous batch (chunked, prefix-cached), sends
the first token as soon as it is sampled, hands the blocks to its transfer worker and
goes on with other requests. When the copy completes it reports checksum and epoch, and
frees its source blocks once decode acknowledges, or the stream ends, or the transfer
fails; never while the sender may still read them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.errors import AbortedError, CancelledError, LayoutMismatchError, UnavailableError
from engine.request import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from engine.transfer.base import SendCompletion
from prefill_service.kv_outbox import KVOutbox
from protos.baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.convert import (
    first_token_from_output,
    kv_descriptor_from_proto,
    sampling_params_from_proto,
    worker_stats_to_proto,
)
from rpc.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, cfg: WorkerConfig):
        assert cfg.role == "prefill"
        self.cfg = cfg
        self.engine: AsyncEngine | None = None
        self.outbox: KVOutbox | None = None
        self._incarnation = uuid.uuid4().hex
        self._cleanups: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Readiness: load weights, allocate KV, warm up, start the transfer worker."""
        core = await asyncio.to_thread(EngineCore, self.cfg.engine, show_progress=False)
        await asyncio.to_thread(core.warm_up)
        self.engine = AsyncEngine(core)
        await self.engine.start()
        self.outbox = KVOutbox(
            self.cfg.transport, core.runner.kv_cache, core.layout, asyncio.get_running_loop()
        )
        logger.info("prefill worker ready (incarnation %s)", self._incarnation)

    async def close(self) -> None:
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=self.cfg.transfer_timeout_s)
        if self.outbox is not None:
            await asyncio.to_thread(self.outbox.close)
        if self.engine is not None:
            await self.engine.shutdown()

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

    async def Prefill(
        self,
        request_iterator: AsyncIterator[worker_pb2.PrefillClientMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.PrefillServerMessage]:
        engine = self._engine()
        assert self.outbox is not None
        incoming = aiter(request_iterator)
        first = await anext(incoming, None)
        if first is None or first.WhichOneof("message") != "request":
            raise ValueError("the first message must be a PrefillRequest")
        req = first.request
        rid = req.request_id
        if not rid:
            raise ValueError("request.request_id is required")
        params = sampling_params_from_proto(req.sampling_params, path="request.sampling_params")
        desc = kv_descriptor_from_proto(req.kv, path="request.kv")
        prompt = list(req.prompt_token_ids)
        if desc.request_id != rid:
            raise ValueError(f"request.kv.request_id {desc.request_id!r} != request_id {rid!r}")
        layout = engine.core.layout
        mismatch = layout.mismatch(desc.endpoint.layout)
        if mismatch:
            raise LayoutMismatchError(f"KV layout of decode worker differs: {mismatch}")
        need = -(-len(prompt) // layout.block_size)
        if len(desc.block_ids) != need:
            raise ValueError(
                f"request.kv.block_ids has {len(desc.block_ids)} blocks; a {len(prompt)}-token "
                f"prompt needs {need}"
            )
        timeout = self.cfg.transfer_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        # Only the first token is sampled here; min_tokens still bars an immediate EOS.
        first_params = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
        )
        out = await _prefill(engine, rid, prompt, first_params)
        sent: asyncio.Future[SendCompletion] | None = None
        try:
            yield worker_pb2.PrefillServerMessage(
                first_token=first_token_from_output(dataclasses.replace(out, finish_reason=None))
            )
            assert out.held_block_ids is not None
            sent = self.outbox.send(rid, out.held_block_ids, desc, timeout)
            completion = await asyncio.shield(sent)
            if not completion.ok:
                assert completion.error is not None
                raise completion.error
            assert completion.checksum is not None
            yield worker_pb2.PrefillServerMessage(
                transfer_complete=worker_pb2.TransferComplete(
                    request_id=rid,
                    checksum=completion.checksum,
                    epoch=completion.epoch,
                    num_bytes=completion.num_bytes,
                )
            )
            ack = await asyncio.wait_for(anext(incoming, None), timeout)
            if ack is None or ack.WhichOneof("message") != "ack":
                raise AbortedError(f"request {rid}: decode closed the stream without an ack")
            if not ack.ack.ok:
                logger.warning("request %s: decode refused the transfer: %s", rid, ack.ack.reason)
        finally:
            if sent is None or sent.done():
                engine.release_held(rid)
            else:
                self.outbox.cancel(rid)
                task = asyncio.create_task(self._release_after(rid, sent))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def _release_after(self, rid: str, sent: asyncio.Future[SendCompletion]) -> None:
        """Free source blocks once the sender has stopped reading them."""
        try:
            await asyncio.wait_for(asyncio.shield(sent), self.cfg.transfer_timeout_s + 5.0)
        except TimeoutError:
            logger.error("request %s: send job did not end; blocks freed anyway", rid)
        self._engine().release_held(rid)

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise UnavailableError("prefill worker is still starting")
        return self.engine


async def _prefill(
    engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams
) -> RequestOutput:
    out: RequestOutput | None = None
    async for item in engine.generate(rid, prompt, params, hold_kv=True):
        out = item
    assert out is not None and out.finished
    if out.finish_reason is FinishReason.ABORT:
        raise CancelledError(f"request {rid} was aborted during prefill")
    return out
