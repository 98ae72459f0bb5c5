"""The DecodeWorker service: reserves KV blocks, has a prefill worker fill them, decodes.

Request life on a decode worker (DESIGN "Request life"): reserve blocks first (the
backpressure point: queue briefly, then RESOURCE_EXHAUSTED), lease them on the KV
receiver, ask the prefill worker to prefill *into* them, verify the transfer (checksum
+ epoch), then forward the first token and let the request join the running batch. In
single-process mode (role ``both``) the engine runs the prompt itself.

A cancel or failure in any phase ends with the blocks free: before the lease has ended
they are handed back only after the receiver reports that no peer can write them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from decode_service.kv_inbox import KVInbox
from engine.async_engine import AsyncEngine, KVLease
from engine.engine_core import EngineCore
from engine.errors import (
    AbortedError,
    DeadlineExceededError,
    ResourceExhaustedError,
    UnavailableError,
)
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from protos.baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from rpc.channels import ChannelCache
from rpc.convert import (
    finish_reason_to_proto,
    kv_descriptor_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    token_logprob_to_proto,
    worker_stats_to_proto,
)
from rpc.errors import typed_rpc_errors
from rpc.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
_RESERVE_POLL_S = 0.02


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, cfg: WorkerConfig):
        assert cfg.role in ("decode", "both")
        self.cfg = cfg
        self.inbox = None
        if cfg.role == "decode":
            # transport_address is a store address for gloo/nccl; shm and cuda_ipc segments
            # get a fresh random name, so any number of workers can share a host.
            address = cfg.transport_address if cfg.transport in ("gloo", "nccl") else ""
            self.inbox = KVInbox(cfg.transport, address)
        self.channels = ChannelCache()
        self.engine: AsyncEngine | None = None
        self._incarnation = ""
        # Each Decode call runs as its own engine request: a retry of the same client id
        # must not collide with an attempt whose blocks are still being reclaimed.
        self._attempts = itertools.count(1)
        # Cleanup tasks for leases still ending after their request was dropped.
        self._cleanups: set[asyncio.Task[None]] = set()

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Readiness: load weights, allocate KV (in shared memory when disaggregated), warm up."""
        loop = asyncio.get_running_loop()
        factory = None
        if self.inbox is not None:
            self.inbox.bind(loop)
            factory = self.inbox.allocate_pool
        core = await asyncio.to_thread(
            EngineCore, self.cfg.engine, kv_pool_factory=factory, show_progress=False
        )
        await asyncio.to_thread(core.warm_up)
        self.engine = AsyncEngine(core)
        await self.engine.start()
        self._incarnation = self.inbox.incarnation if self.inbox else uuid.uuid4().hex
        logger.info(
            "decode worker ready (role=%s, incarnation %s)", self.cfg.role, self._incarnation
        )

    async def close(self) -> None:
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=self.cfg.transfer_timeout_s)
        if self.engine is not None:
            await self.engine.shutdown()
        if self.inbox is not None:
            await asyncio.to_thread(self.inbox.close)
        await self.channels.close()

    # -- RPCs -------------------------------------------------------------------------

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        engine = self._engine()
        return worker_stats_to_proto(
            self.cfg.role,
            self._incarnation,
            engine.stats(),
            engine.busy_fraction(),
            engine.core.layout,
        )

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        engine = self._engine()
        if not request.request_id:
            raise ValueError("request_id is required")
        rid = f"{request.request_id}#{next(self._attempts)}"
        params = sampling_params_from_proto(request.sampling_params)
        prompt = list(request.prompt_token_ids)
        remaining = context.time_remaining()
        if self.cfg.role == "both":
            if request.prefill_address:
                raise ValueError(
                    "prefill_address must be empty: this worker runs prompts itself "
                    "(single-process)"
                )
            stream = engine.generate(rid, prompt, params)
            async for msg in _responses(stream, len(prompt), first_token=None):
                yield msg
            return
        if not request.prefill_address:
            raise ValueError("prefill_address is required: this worker only decodes")
        async for msg in self._disaggregated(
            rid, prompt, params, request.prefill_address, remaining
        ):
            yield msg

    # -- the hand-off -----------------------------------------------------------------

    async def _disaggregated(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        prefill: str,
        remaining: float | None,
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        engine = self._engine()
        assert self.inbox is not None
        lease, stream = await self._reserve(rid, prompt, params, remaining)
        timeout = self.cfg.transfer_timeout_s
        if remaining is not None:
            timeout = min(timeout, remaining)
        lease_ended: asyncio.Future | None = None
        call = None
        handed_over = False
        try:
            desc, lease_ended = self.inbox.lease(rid, lease.block_ids, timeout)
            stub = worker_pb2_grpc.PrefillWorkerStub(self.channels.get(prefill))
            call = stub.Prefill(timeout=remaining)
            with typed_rpc_errors(f"prefill {prefill}"):
                await call.write(
                    worker_pb2.PrefillClientMessage(
                        request=worker_pb2.PrefillRequest(
                            request_id=rid,
                            prompt_token_ids=prompt,
                            sampling_params=sampling_params_to_proto(params),
                            kv=kv_descriptor_to_proto(desc),
                        )
                    )
                )
                first = await _read(call, "first_token", timeout, prefill)
                done = await _read(call, "transfer_complete", timeout, prefill)
            self.inbox.verify(rid, done.checksum, done.epoch)
            completion = await asyncio.wait_for(asyncio.shield(lease_ended), timeout + 5.0)
            ack = worker_pb2.TransferAck(
                request_id=rid,
                ok=completion.ok,
                reason="" if completion.ok else str(completion.error),
            )
            with typed_rpc_errors(f"prefill {prefill}"):
                await call.write(worker_pb2.PrefillClientMessage(ack=ack))
                await call.done_writing()
            if not completion.ok:
                assert completion.error is not None
                raise completion.error
            engine.kv_ready(rid, first.token_id)
            handed_over = True
            # The first token goes out only once its KV is verified: until then a failed
            # hand-off is still invisible to the client and the gateway may retry it.
            yield worker_pb2.DecodeResponse(
                token_ids=[first.token_id],
                logprobs=[first.logprob] if first.HasField("logprob") else [],
            )
            async for msg in _responses(stream, len(prompt), first_token=first):
                yield msg
        except TimeoutError as exc:
            raise DeadlineExceededError(f"KV hand-off of request {rid} timed out") from exc
        finally:
            if call is not None and not call.done():
                call.cancel()
            if handed_over or lease_ended is None:
                engine.discard(rid)
            else:
                self.inbox.cancel(rid)
                task = asyncio.create_task(self._discard_after(rid, lease_ended))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def _discard_after(self, rid: str, lease_ended: asyncio.Future) -> None:
        """Free a request's blocks once its lease has ended (no peer can write them)."""
        try:
            await asyncio.wait_for(asyncio.shield(lease_ended), self.cfg.transfer_timeout_s + 5.0)
        except TimeoutError:
            logger.error("request %s: lease did not end; blocks freed anyway", rid)
        self._engine().discard(rid)

    async def _reserve(
        self, rid: str, prompt: list[int], params: SamplingParams, remaining: float | None
    ) -> tuple[KVLease, AsyncIterator[RequestOutput]]:
        """Reserve KV blocks, waiting briefly for them when the pool is full."""
        engine = self._engine()
        limit = (
            self.cfg.reserve_timeout_s
            if remaining is None
            else min(self.cfg.reserve_timeout_s, remaining)
        )
        give_up = time.monotonic() + limit
        while True:
            try:
                return await engine.reserve(rid, prompt, params)
            except ResourceExhaustedError:
                if time.monotonic() >= give_up:
                    raise
            await asyncio.sleep(_RESERVE_POLL_S)

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise UnavailableError("decode worker is still starting")
        return self.engine


async def _read(call: grpc.aio.StreamStreamCall, kind: str, timeout: float, peer: str):  # noqa: ANN202
    msg = await asyncio.wait_for(call.read(), timeout)
    if msg is grpc.aio.EOF:
        raise AbortedError(f"prefill {peer} closed the stream before sending {kind}")
    which = msg.WhichOneof("message")
    if which != kind:
        raise AbortedError(f"prefill {peer} sent {which} where {kind} was expected")
    return getattr(msg, kind)


async def _responses(
    stream: AsyncIterator[RequestOutput], num_prompt: int, first_token: worker_pb2.FirstToken | None
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    completion = 1 if first_token is not None else 0
    cached = first_token.num_cached_tokens if first_token is not None else 0
    async for out in stream:
        completion += len(out.new_token_ids)
        cached = cached or out.num_cached_tokens
        msg = worker_pb2.DecodeResponse(
            token_ids=out.new_token_ids,
            logprobs=[token_logprob_to_proto(lp) for lp in out.logprobs or []],
        )
        if out.finished:
            msg.finish_reason = finish_reason_to_proto(out.finish_reason)
            msg.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=num_prompt,
                    completion_tokens=completion,
                    cached_tokens=cached,
                )
            )
        yield msg
