"""The DecodeWorker service: wiring only.

Single-process mode (role ``both``) runs the prompt in this worker's engine, and so does a
decode worker asked with no prefill address (the gateway's conditional disaggregation: a
short or mostly cached prompt). Otherwise the KV hand-off with the prefill worker the
gateway chose (if it is in this worker's fleet, ``decode_service.prefill_fleet``) runs
in ``decode_service.handoff`` (reserve,
lease, prefill, verify, ack), over a ``GrpcPrefillLink`` (mTLS when configured). Stats
and health come from the engine's published snapshot. If the engine thread or the KV
receiver's thread dies, open streams end with UNAVAILABLE (those still in their
hand-off at once, ``rpc.liveness.unless_fatal``) and the worker reports NOT_SERVING for
good (``fatal``), so a liveness probe restarts it; while the engine is stuck in a step
past ``--engine-stall-timeout-s`` it reports NOT_SERVING until it steps again
(``stalled``). On SIGTERM (``drain``) streams get ``--drain-finish-s`` to finish, then
the rest are handed back to the gateway to move to another decode worker.

The ``traceparent`` of a ``Decode`` call is the parent of the request's spans here
(``decode.reserve``, ``decode.wait_kv``, ``decode.decode``; single-process one
``decode.generate``), and the messages carry its timings (``decode_service.timings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from decode_service.choices import fan_out
from decode_service.handoff import DecodeHandoff, HandoffLimits, PrefillLink
from decode_service.kv_inbox import KVInbox
from decode_service.prefill_fleet import PrefillFleet
from decode_service.prefill_link import GrpcPrefillLink
from decode_service.prefill_peers import PrefillPeers
from decode_service.timings import with_timings
from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.errors import UnavailableError
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.timeline import OFF, Timeline, TimelineRecorder
from engine.transfer.base import TransferConfig
from engine.transfer.fleet_auth import FleetKey
from protos.baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from rpc.channels import CHANNEL_OPTIONS, ChannelCache
from rpc.convert import (
    finish_reason_to_proto,
    request_timings_to_proto,
    sampling_params_from_proto,
    token_logprob_to_proto,
    worker_stats_to_proto,
)
from rpc.errors import WorkerDrainingError
from rpc.kv_events import kv_event_stream
from rpc.liveness import EngineStall, unless_fatal
from rpc.tls import TlsMaterial, server_name_option
from rpc.tracing import context_from_metadata, span
from rpc.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name

# Of the grace period, what a drain keeps for handed-back streams to reach the gateway.
_HANDOFF_MARGIN_S = 1.0
_DRAIN_POLL_S = 0.05


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """``tls``: this worker's PEM material (it dials prefill workers with it as its client
    identity); ``fleet_key``: the fleet's shared secret for the KV hand-off. Both are read
    once in ``__main__``, which also builds ``tracer_provider`` (None: no spans)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        *,
        tls: TlsMaterial | None = None,
        fleet_key: FleetKey | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ):
        assert cfg.role in ("decode", "both")
        self.cfg = cfg
        provider = tracer_provider or trace.NoOpTracerProvider()
        self._tracer = provider.get_tracer("baton.decode")
        # The engine loop's and the KV receiver's spans, written on close (--timeline-file).
        self.timeline: TimelineRecorder = (
            Timeline("decode" if cfg.role == "decode" else "worker") if cfg.timeline_file else OFF
        )
        self.inbox = None
        self._fleet_key = fleet_key
        if cfg.role == "decode":
            # transport_address is a store address for gloo/nccl; shm and cuda_ipc segments
            # get a fresh random name, so any number of workers can share a host.
            address = cfg.transport_address if cfg.transport in ("gloo", "nccl") else ""
            self.inbox = KVInbox(
                cfg.transport,
                address,
                TransferConfig(fleet_key=fleet_key),
                device=cfg.engine.device,
                timeline=self.timeline,
                on_failure=self._receiver_died,
            )
        self.channels = ChannelCache(
            CHANNEL_OPTIONS + server_name_option(cfg.tls_server_name),
            tls.channel_credentials() if tls is not None else None,
        )
        self.prefill_fleet = PrefillFleet(cfg.prefill_allow)
        self.engine: AsyncEngine | None = None
        self.handoff: DecodeHandoff | None = None
        self._incarnation = uuid.uuid4().hex
        # Each Decode call runs as its own engine request: a retry of the same client id
        # must not collide with an attempt whose blocks are still being reclaimed, nor
        # (on a shared prefill worker) with another decode worker's attempt.
        self._attempts = itertools.count(1)
        self._fatal: asyncio.Future[str] | None = None
        self._stall = EngineStall(
            cfg.engine_stall_timeout_s,
            lambda: self.engine.snapshot_age_s if self.engine is not None else None,
        )

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Readiness: load weights, allocate KV (in shared memory when disaggregated), warm up."""
        loop = asyncio.get_running_loop()
        self._fatal = loop.create_future()
        factory = None
        if self.inbox is not None:
            self.inbox.bind(loop)
            factory = self.inbox.allocate_pool
        core = await asyncio.to_thread(
            EngineCore, self.cfg.engine, kv_pool_factory=factory, show_progress=False
        )
        await asyncio.to_thread(core.warm_up)
        self.engine = AsyncEngine(core, on_death=self._engine_died, timeline=self.timeline)
        await self.engine.start()
        if self.inbox is not None:
            self._incarnation = self.inbox.incarnation
            limits = HandoffLimits(self.cfg.transfer_timeout_s)
            # What a restarted, moved, departed or idle prefill worker leaves goes.
            peers = PrefillPeers(
                self.inbox.forget_sender,
                drop_channel=self.channels.discard,
                departed=self.prefill_fleet.departed,
            )
            self.handoff = DecodeHandoff(
                self.engine,
                self.inbox,
                limits,
                self._open_link,
                self._fleet_key,
                self._tracer,
                peers=peers,
            )
        logger.info(
            "decode worker ready (role=%s, incarnation %s)", self.cfg.role, self._incarnation
        )

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
        if self.engine is not None:
            await self.engine.shutdown()
        if self.inbox is not None:
            await asyncio.to_thread(self.inbox.close)
        await self.channels.close()
        if isinstance(self.timeline, Timeline) and self.cfg.timeline_file is not None:
            await asyncio.to_thread(self.timeline.write, self.cfg.timeline_file)
            logger.info("engine timeline written to %s", self.cfg.timeline_file)

    async def drain(self) -> None:
        """On SIGTERM (``ServerSpec.on_stop``, beside the gate's drain): let streams finish
        for ``drain_finish_s``, then hand the rest back: each ends with ABORTED and the
        drain marker (``WorkerDrainingError``), which the gateway answers by moving the
        request to another decode worker. Leaves a margin of the grace period for those
        endings to reach the gateway before the server cancels what is left."""
        engine = self.engine
        if engine is None:
            return
        finish = min(self.cfg.drain_finish_s, max(0.0, self.cfg.grace_s - _HANDOFF_MARGIN_S))
        loop = asyncio.get_running_loop()
        give_up = loop.time() + finish
        while engine.num_streams and loop.time() < give_up:
            await asyncio.sleep(min(_DRAIN_POLL_S, give_up - loop.time()))
        if not engine.num_streams:
            return
        ended = engine.end_streams(
            lambda rid: WorkerDrainingError(
                f"request {rid}: this decode worker is draining and handed the request back "
                f"after {finish:g}s; continue it on another decode worker"
            )
        )
        logger.info(
            "decode draining: %d stream(s) still open after %.1fs; handed back to the gateway",
            ended,
            finish,
        )

    def _engine_died(self, exc: BaseException) -> None:
        logger.error("decode engine died: %r; reporting NOT_SERVING", exc)
        self._cannot_serve(f"engine thread died: {exc!r}")

    def _receiver_died(self, exc: BaseException) -> None:
        logger.error("KV receiver thread died: %r; reporting NOT_SERVING", exc)
        self._cannot_serve(f"KV receiver thread died: {exc!r}")

    def _cannot_serve(self, reason: str) -> None:
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_result(reason)

    def _open_link(
        self, address: str, timeout: float | None, trace_context: Context | None
    ) -> PrefillLink:
        return GrpcPrefillLink(self.channels.get(address), address, timeout, trace_context)

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

    async def KVEvents(
        self, request: worker_pb2.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KVEventBatch]:
        core = self._engine().core
        async for batch in kv_event_stream(core.kv_events, core.layout.block_size):
            yield batch

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        began = time.monotonic()
        engine = self._engine()
        if not request.request_id:
            raise ValueError("request_id is required")
        # Counts first: nothing is copied out of the message for a prompt that cannot fit.
        num_prompt, max_len = len(request.prompt_token_ids), engine.core.max_model_len
        if num_prompt >= max_len:
            raise ValueError(
                f"prompt_token_ids has {num_prompt} tokens; max_model_len is {max_len}"
            )
        rid = f"{request.request_id}#{self._incarnation[:12]}.{next(self._attempts)}"
        choices = sampling_params_from_proto(request.sampling_params)
        params = choices.choice(0)
        prompt = list(request.prompt_token_ids)
        parent = context_from_metadata(context.invocation_metadata())
        if self.cfg.role == "both":
            if request.prefill_address:
                raise ValueError(
                    "prefill_address must be empty: this worker runs prompts itself "
                    "(single-process)"
                )
            outputs = self._generate(rid, prompt, params, parent)
        elif not request.prefill_address:
            # Conditional disaggregation: the gateway keeps a short or mostly cached prompt
            # here, where its prefix cache serves what it holds and the rest is chunked
            # into steps bounded by --max-prefill-tokens-while-decoding.
            outputs = self._generate(rid, prompt, params, parent)
        else:
            await self.prefill_fleet.check(request.prefill_address)
            assert self.handoff is not None
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            outputs = self.handoff.run(
                rid, prompt, params, request.prefill_address, deadline, trace_context=parent
            )
        outputs = fan_out(
            outputs,
            lambda i: self._generate(f"{rid}/{i}", prompt, choices.choice(i), parent),
            choices.n,
        )
        assert self._fatal is not None
        outputs = unless_fatal(outputs, self._fatal)
        # Closed explicitly, so leaving early frees the request now, not at GC.
        async with contextlib.aclosing(outputs):
            async for msg in _responses(with_timings(outputs, began), len(prompt)):
                yield msg

    async def _generate(
        self, rid: str, prompt: list[int], params: SamplingParams, parent: Context
    ) -> AsyncIterator[RequestOutput]:
        """The prompt and the decode in this engine, one span (single-process, or a prompt
        the gateway chose to prefill on this decode worker)."""
        outputs = self._engine().generate(rid, prompt, params)
        with span(self._tracer, "decode.generate", parent, request_id=rid):
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield out

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise UnavailableError("decode worker is still starting")
        return self.engine


async def _responses(
    outputs: AsyncIterator[RequestOutput], num_prompt: int
) -> AsyncIterator[worker_pb2.DecodeResponse]:
    # Per choice (fan_out's index): each choice's last message has its own usage.
    completion: dict[int, int] = {}
    cached = 0
    async for out in outputs:
        completion[out.index] = completion.get(out.index, 0) + len(out.new_token_ids)
        if out.index == 0:  # the prompt's cache hits, as the hand-off reported them
            cached = cached or out.num_cached_tokens
        msg = worker_pb2.DecodeResponse(
            index=out.index,
            token_ids=out.new_token_ids,
            logprobs=[token_logprob_to_proto(lp) for lp in out.logprobs or []],
            prompt_logprobs=[token_logprob_to_proto(lp) for lp in out.prompt_logprobs or []],
        )
        if out.timings is not None:
            msg.timings.CopyFrom(request_timings_to_proto(out.timings))
        if out.finished:
            msg.finish_reason = finish_reason_to_proto(out.finish_reason)
            msg.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=num_prompt,
                    completion_tokens=completion[out.index],
                    cached_tokens=cached,
                )
            )
        yield msg
