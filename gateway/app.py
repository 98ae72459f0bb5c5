"""The assembled gateway: model, router, dispatcher, the one request path and its front
ends (the gRPC servicer; the OpenAI-compatible HTTP API when ``http_port`` is set), wired
from one config.

Limits and security come from the config too: the cap on concurrent streams, the public
message size (from max_model_len), TLS on the public ports, API keys (gRPC metadata and
the HTTP header alike), and mTLS towards the workers.

``__main__`` runs it under ``rpc.server.serve``; tests run it under an ``RpcServer``. The
server reports SERVING once the tokenizer is loaded and a decode worker answered Stats;
the HTTP listener binds first thing in ``ready`` and admits requests from then on, and
drains beside the gRPC server when it stops.
"""

from __future__ import annotations

import asyncio
import logging

import grpc.aio
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from gateway.config import GatewayConfig
from gateway.generation import Generation
from gateway.grpc_api.servicer import BatonServicer
from gateway.http.api import build_app
from gateway.http.server import HttpServer
from gateway.metrics import (
    GatewayMetrics,
    KernelRoutesCollector,
    RoutingCollector,
    WorkersCollector,
)
from gateway.routing.discovery import Resolver, system_resolver
from gateway.routing.dispatcher import Dispatcher
from gateway.routing.kv_feed import KVFeed
from gateway.routing.kv_index import KVIndex
from gateway.routing.router import Router
from gateway.served_model import ServedModel, locate_model
from protos.baton.v1 import generate_pb2, generate_pb2_grpc
from rpc.auth import ApiKeyInterceptor, ApiKeys
from rpc.channels import CHANNEL_OPTIONS, ChannelCache, public_message_bytes, server_options
from rpc.server import ServerSpec
from rpc.tls import server_name_option

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Baton"].full_name


class Gateway:
    """One gateway instance. Build it on the loop that serves it; ``aclose`` it once done.

    ``model`` replaces the one named by the config (tests share one loaded tokenizer); the
    gateway closes only a model it made itself. ``tracer_provider`` (built in ``__main__``,
    or an in-memory one in tests) records the request spans; None records none.
    ``resolver`` looks up ``dns:///`` targets (tests inject one). With a ``registry`` the
    gateway's metrics are registered on it.
    """

    def __init__(
        self,
        config: GatewayConfig,
        model: ServedModel | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        resolver: Resolver = system_resolver,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        # Files are read once, here: a bad one fails start-up, naming its flag.
        self._tls = config.tls.load()
        worker_tls = config.worker_tls.load()
        self.api_keys = ApiKeys.from_file(config.api_keys_file) if config.api_keys_file else None
        self.channels = ChannelCache(
            CHANNEL_OPTIONS + server_name_option(config.worker_tls_server_name),
            worker_tls.channel_credentials() if worker_tls is not None else None,
        )
        self._owns_model = model is None
        self.model = model or ServedModel(
            locate_model(config.model, config.model_cache_dir), config.max_model_len
        )
        # The public port reads no message larger than a prompt of max_model_len can be.
        self.max_message_bytes = public_message_bytes(self.model.max_model_len())
        self.router = Router(
            config.decode,
            config.prefill,
            self.channels,
            resolver=resolver,
            poll_interval_s=config.stats_interval_s,
            stats_timeout_s=config.stats_timeout_s,
            down_after_s=config.worker_down_after_s,
            resolve_interval_s=config.resolve_interval_s,
            wait_for_worker_s=config.wait_for_worker_s,
            same_host_prefill=config.same_host_prefill,
            kv_feed=KVFeed(KVIndex(), self.channels) if config.routing == "kv" else None,
            cache_weight=config.kv_cache_weight,
            local_prefill_tokens=config.local_prefill_tokens,
            local_cached_fraction=config.local_prefill_cached_fraction,
        )
        tracer = (tracer_provider or trace.NoOpTracerProvider()).get_tracer("baton.gateway")
        self.dispatcher = Dispatcher(
            self.router,
            self.channels,
            max_retries=config.max_retries,
            max_migrations=config.max_migrations,
            tracer=tracer,
        )
        self.metrics = GatewayMetrics(registry) if registry is not None else None
        if registry is not None:
            registry.register(
                WorkersCollector(lambda: ((w.kind.value, w.up) for w in self.router.workers))
            )
            registry.register(
                RoutingCollector(
                    lambda: (
                        self.router.routed_prompt_tokens,
                        self.router.routed_cached_tokens,
                        self.router.local_prefills,
                        self.router.remote_prefills,
                    )
                )
            )
            registry.register(
                KernelRoutesCollector(
                    lambda: ((w.address, dict(w.cpu_kernel_routes)) for w in self.router.workers)
                )
            )
        self.generation = Generation(
            self.model,
            self.dispatcher,
            tracer,
            self.metrics,
            max_streams=config.max_concurrent_streams,
        )
        self.servicer = BatonServicer(self.generation)
        self.http: HttpServer | None = None
        if config.http_port is not None:
            app = build_app(self.generation, request_timeout_s=config.http_request_timeout_s)
            self.http = HttpServer(
                app,
                host=config.host,
                port=config.http_port,
                grace_s=config.grace_s,
                port_file=config.http_port_file,
                tls=config.tls if self._tls is not None else None,
                api_keys=self.api_keys,
            )

    def spec(self) -> ServerSpec:
        return ServerSpec(
            name="gateway",
            register=self._register,
            service_names=(SERVICE_NAME,),
            host=self.config.host,
            port=self.config.port,
            ready=self.ready,
            grace_s=self.config.grace_s,
            port_file=self.config.port_file,
            on_stop=self.stop_http,
            options=server_options(self.max_message_bytes),
            credentials=(
                self._tls.server_credentials(require_client_cert=False)
                if self._tls is not None
                else None
            ),
            interceptors=(ApiKeyInterceptor(self.api_keys),) if self.api_keys else (),
        )

    async def ready(self) -> None:
        """Bind the HTTP port (if any), then load the tokenizer and wait for a decode
        worker, side by side; then admit HTTP requests."""
        if self.http is not None:
            await self.http.start()
        self.router.start()
        logger.info(
            "gateway: loading %s; waiting for a decode worker of %s (prefill: %s)",
            self.model.source.name,
            ", ".join(self.config.decode),
            ", ".join(self.config.prefill) or "none, single-process workers",
        )
        await asyncio.gather(self.model.load(), self.router.wait_ready())
        if self.http is not None:
            self.http.open()

    async def stop_http(self) -> None:
        """Drain and stop the HTTP listener (a no-op without one, or after the first call)."""
        if self.http is not None:
            await self.http.stop()

    async def aclose(self) -> None:
        await self.stop_http()
        await self.router.close()
        await self.channels.close()
        if self._owns_model:
            self.model.close()

    def _register(self, server: grpc.aio.Server) -> None:
        generate_pb2_grpc.add_BatonServicer_to_server(self.servicer, server)
