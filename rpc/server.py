"""The one gRPC server lifecycle that gateway, prefill and decode share.

The official asyncio pattern (grpc ``async_greeter_server_with_graceful_shutdown.py``),
plus what a model server needs around it::

    start:  server with ErrorInterceptor (+ spec.interceptors, e.g. API keys) -> register
            servicers -> health (NOT_SERVING) -> reflection (v1 + v1alpha; if
            spec.reflection) -> bind (TLS with spec.credentials) -> start -> health of
            ALIVE_SERVICE SERVING -> port file -> await spec.ready() -> health SERVING,
            calls admitted
    stop:   health NOT_SERVING (ALIVE_SERVICE too) -> new calls refused with UNAVAILABLE
            -> in-flight calls drain for up to spec.grace_s -> server.stop() cancels what
            is left

Until ``ready`` returns, and from the moment stopping begins, every call other than
health and reflection is refused with UNAVAILABLE, so a caller can retry elsewhere. So
it is, for good, once ``spec.fatal`` resolves (the engine died), and, for as long as it
lasts, while ``spec.liveness`` names a reason (the engine is stuck in a step): health
always says SERVING exactly when calls are admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.errors import UnavailableError
from rpc.channels import SERVER_OPTIONS
from rpc.drain_gate import DrainGate
from rpc.errors import ErrorInterceptor, wrap_handler
from rpc.reflection import SERVICE_NAMES as REFLECTION_SERVICES
from rpc.reflection import enable_reflection

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Calls to these are always admitted and never counted as in flight: probes must work
# while the server starts and drains, and a health Watch stream never ends by itself.
_INFRA_PREFIXES = tuple(f"/{name}/" for name in (health.SERVICE_NAME, *REFLECTION_SERVICES))
# Streams that never end by themselves and carry no request (a worker's KV events): not
# counted as in flight, so a drain does not wait its whole grace period on them; the
# server's stop cancels them.
_ENDLESS_SUFFIXES = ("/KVEvents",)
# A health entry SERVING from the moment the server listens until it starts draining,
# whether or not it is ready: what a startup or liveness probe asks when the process must
# count as started while it waits on others (the gateway on its decode workers).
ALIVE_SERVICE = "baton.alive"


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """Everything the lifecycle needs from one service. Built once, in ``__main__``."""

    name: str  # for logs: "gateway", "prefill", "decode", ...
    # Adds the servicers to the server (``add_XServicer_to_server(servicer, server)``).
    register: Callable[[grpc.aio.Server], None]
    # Full names of the registered services (``baton.v1.DecodeWorker``), for health
    # and reflection.
    service_names: Sequence[str]
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound one is logged and written to port_file
    # Awaited after start; SERVING once it returns (weights loaded, KV allocated, warm-up
    # done). If it raises, the server stops and serve() re-raises. None: ready at once.
    ready: Callable[[], Awaitable[None]] | None = None
    grace_s: float = 30.0  # how long in-flight calls may drain on stop
    port_file: Path | None = None  # written atomically with the bound port, if set
    options: tuple[tuple[str, int], ...] = SERVER_OPTIONS
    # TLS (or mTLS) for the port (``rpc.tls``); None: plaintext.
    credentials: grpc.ServerCredentials | None = None
    # Serve reflection (grpcurl, buf curl): on for the public gateway, off by default on
    # workers, which only their fleet calls.
    reflection: bool = True
    # Run after ErrorInterceptor and before admission (e.g. ``rpc.auth``'s API keys).
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    # Awaited once ready; when it returns (a reason), the service can no longer serve
    # (its engine died): health goes NOT_SERVING and new calls are refused with
    # UNAVAILABLE, so probes and the gateway route around it. None: never.
    fatal: Callable[[], Awaitable[str]] | None = None
    # Called every ``liveness_interval_s`` once ready (``rpc.liveness``): a reason while
    # the service cannot serve for now (its engine is stuck in a step), None while it
    # can. Health and admission follow it both ways, unlike ``fatal``. None: not polled.
    liveness: Callable[[], str | None] | None = None
    liveness_interval_s: float = 1.0
    # Awaited when stopping begins, beside the drain of gRPC calls and within the same
    # grace period: another front end of the service (the gateway's HTTP API) drains here.
    on_stop: Callable[[], Awaitable[None]] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")
        if self.liveness_interval_s <= 0:
            raise ValueError(f"liveness_interval_s must be > 0, got {self.liveness_interval_s!r}")
        if not self.service_names:
            raise ValueError("service_names must name at least one service")


class _Gate(DrainGate, grpc.aio.ServerInterceptor):
    """Admits calls only while serving, and counts the ones in flight.

    Refusals raise UnavailableError inside the call, so ErrorInterceptor (outside this
    one) is still the only place that picks a status code.
    """

    def __init__(self) -> None:
        DrainGate.__init__(self, "server is starting")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if method.startswith(_INFRA_PREFIXES) or method.endswith(_ENDLESS_SUFFIXES):
            return handler
        return wrap_handler(handler, self._admit)

    def _admit(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def admitted_stream(request: Any, context: Any) -> AsyncIterator:
                with self._admitted():
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for response in responses:
                            yield response

            return admitted_stream

        if inspect.iscoroutinefunction(behavior):

            async def admitted(request: Any, context: Any) -> Any:
                with self._admitted():
                    return await behavior(request, context)

            return admitted

        return behavior

    @contextlib.contextmanager
    def _admitted(self) -> Iterator[None]:
        if not self.open:
            raise UnavailableError(self.reason)
        with self._counted():
            yield


class RpcServer:
    """One server: ``start`` it, then ``stop`` it; :func:`serve` does both around signals."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.port = 0  # the bound port, once started
        self.health_servicer = health.aio.HealthServicer()
        self.ready_error: Exception | None = None  # what spec.ready raised, if it did
        self._server: grpc.aio.Server | None = None
        self._gate = _Gate()
        self._ready_task: asyncio.Task[None] | None = None
        self._fatal_task: asyncio.Task[None] | None = None
        self._liveness_task: asyncio.Task[None] | None = None
        self._fatal_reason: str | None = None  # once spec.fatal resolved
        self._stopping: asyncio.Task[None] | None = None
        # Health updates await (Watch streams); one at a time, so the last one wins.
        self._health_lock = asyncio.Lock()

    @property
    def in_flight(self) -> int:
        """Calls being served now (health and reflection not counted)."""
        return self._gate.in_flight

    @property
    def serving(self) -> bool:
        return self._gate.open

    async def start(self) -> int:
        """Bind, start, and begin awaiting readiness; returns the bound port. Call once."""
        spec = self.spec
        if self._server is not None:
            raise RuntimeError(f"{spec.name}: server already started")
        server = grpc.aio.server(
            interceptors=[ErrorInterceptor(), *spec.interceptors, self._gate],
            options=list(spec.options),
        )
        spec.register(server)
        for name in ("", *spec.service_names):
            await self.health_servicer.set(name, NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, server)
        if spec.reflection:
            enable_reflection((*spec.service_names, health.SERVICE_NAME), server)
        address = f"{spec.host}:{spec.port}"
        if spec.credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, spec.credentials)
        if port == 0:
            raise OSError(f"{spec.name}: could not bind {address}")
        await server.start()
        await self.health_servicer.set(ALIVE_SERVICE, SERVING)
        self._server, self.port = server, port
        logger.info(
            "%s listening on %s:%d (%s)",
            spec.name,
            spec.host,
            port,
            "TLS" if spec.credentials is not None else "plaintext",
        )
        if spec.port_file is not None:
            write_port_file(spec.port_file, port)
        self._ready_task = asyncio.create_task(self._become_ready(), name=f"{spec.name}-ready")
        return port

    async def wait_ready(self) -> None:
        """Return once SERVING; raise what ``spec.ready`` raised if it failed."""
        if self._ready_task is None:
            raise RuntimeError(f"{self.spec.name}: server not started")
        await asyncio.shield(self._ready_task)
        if self.ready_error is not None:
            raise self.ready_error

    async def _become_ready(self) -> None:
        try:
            if self.spec.ready is not None:
                await self.spec.ready()
        except Exception as exc:
            logger.exception("%s failed to become ready; stopping", self.spec.name)
            self.ready_error = exc
            self._stopping = self._stopping or asyncio.create_task(self._stop())
            return
        if self._stopping is not None:
            return
        self._gate.open = True
        await self._sync_health()
        logger.info("%s is SERVING", self.spec.name)
        if self.spec.fatal is not None:
            self._fatal_task = asyncio.create_task(self._watch_fatal(self.spec.fatal))
        if self.spec.liveness is not None:
            self._liveness_task = asyncio.create_task(
                self._watch_liveness(self.spec.liveness, self.spec.liveness_interval_s)
            )

    async def _sync_health(self) -> None:
        """Health of every service := whether calls are admitted now."""
        async with self._health_lock:
            status = SERVING if self._gate.open else NOT_SERVING
            for name in ("", *self.spec.service_names):
                await self.health_servicer.set(name, status)

    async def _watch_fatal(self, fatal: Callable[[], Awaitable[str]]) -> None:
        reason = await fatal()
        if self._stopping is not None:
            return
        logger.error("%s cannot serve any more (%s): NOT_SERVING", self.spec.name, reason)
        self._fatal_reason = reason
        self._gate.close(f"{self.spec.name} cannot serve: {reason}")
        await self._sync_health()

    async def _watch_liveness(self, liveness: Callable[[], str | None], interval: float) -> None:
        name = self.spec.name
        wedged: str | None = None
        while True:
            await asyncio.sleep(interval)
            try:
                reason = liveness()
            except Exception as exc:
                # A check that cannot answer cannot vouch for the service either.
                logger.exception("%s: liveness check failed", name)
                reason = f"liveness check failed: {exc!r}"
            if self._stopping is not None or self._fatal_reason is not None:
                return
            if (reason is None) == (wedged is None):
                continue
            wedged = reason
            if reason is not None:
                logger.error("%s cannot serve for now (%s): NOT_SERVING", name, reason)
                self._gate.close(f"{name} cannot serve for now: {reason}")
            else:
                logger.info("%s can serve again: SERVING", name)
                self._gate.open = True
            await self._sync_health()

    async def stop(self) -> None:
        """Drain and stop (see the module doc). Safe to call twice or concurrently."""
        if self._server is None:
            return
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        assert self._server is not None
        name, grace = self.spec.name, self.spec.grace_s
        began = time.monotonic()
        if self._ready_task is not None and not self._ready_task.done():
            self._ready_task.cancel()
        for task in (self._fatal_task, self._liveness_task):
            if task is not None and not task.done():
                task.cancel()
        await self.health_servicer.enter_graceful_shutdown()
        self._gate.close(f"{name} is shutting down")
        also = asyncio.create_task(self.spec.on_stop()) if self.spec.on_stop else None
        logger.info(
            "%s draining: %d call(s) in flight, grace %.1fs", name, self._gate.in_flight, grace
        )
        if not await self._gate.wait_idle(grace):
            logger.warning(
                "%s: %d call(s) still in flight after %.1fs; cancelling them",
                name,
                self._gate.in_flight,
                grace,
            )
        if also is not None:
            try:
                await also
            except Exception:
                logger.exception("%s: on_stop failed", name)
        # Cancels whatever is left, including health Watch streams, which never end.
        await self._server.stop(0)
        logger.info("%s stopped after %.2fs", name, time.monotonic() - began)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


async def serve(spec: ServerSpec) -> None:
    """Run a server until SIGTERM or SIGINT, then drain and stop. For a service's ``__main__``.

    Raises what ``spec.ready`` raised if the service could not become ready (after
    stopping the server).
    """
    server = RpcServer(spec)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, spec.name, sig, stop_requested)
    waits: list[asyncio.Task[Any]] = []
    try:
        await server.start()
        ready = asyncio.create_task(server.wait_ready())
        stop = asyncio.create_task(stop_requested.wait())
        waits = [ready, stop]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is not None:
            raise ready.exception()  # type: ignore[misc]
        if ready.done():
            # What start-up built (weights, tokenizer, modules) lives as long as the
            # process: keep full collections from walking it again and again under load
            # (~0.2 s a pause on a gateway, felt by every stream and every refusal).
            gc.collect()
            gc.freeze()
        await stop
    finally:
        for task in waits:
            task.cancel()
        # A second SIGINT stops at once (the default action); a repeated SIGTERM is the
        # same request again (an entrypoint repeats it until its workers exit) and must
        # not cut the drain short.
        loop.remove_signal_handler(signal.SIGINT)
        loop.add_signal_handler(signal.SIGTERM, _on_repeat, spec.name)
        try:
            await server.stop()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)


def _on_signal(name: str, sig: signal.Signals, stop_requested: asyncio.Event) -> None:
    logger.info("%s received %s", name, sig.name)
    stop_requested.set()


def _on_repeat(name: str) -> None:
    logger.debug("%s received SIGTERM again while stopping; draining goes on", name)


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` to ``path`` atomically: a reader sees nothing or the whole number."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
