"""The assembled gateway: model, router, dispatcher and servicer, wired from one config.

``__main__`` runs it under ``rpc.server.serve``; tests run it under an ``RpcServer``. The
server reports SERVING once the tokenizer is loaded and a decode worker answered Stats.
"""

from __future__ import annotations

import asyncio
import logging

import grpc.aio
from prometheus_client import CollectorRegistry

from gateway.config import GatewayConfig
from gateway.discovery import Resolver, system_resolver
from gateway.dispatcher import Dispatcher
from gateway.metrics import GatewayMetrics, WorkersCollector
from gateway.router import Router
from gateway.served_model import ServedModel, locate_model
from gateway.servicer import BatonServicer
from protos.baton.v1 import generate_pb2, generate_pb2_grpc
from rpc.channels import ChannelCache
from rpc.server import ServerSpec

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Baton"].full_name


class Gateway:
    """One gateway instance. Build it on the loop that serves it; ``aclose`` it once done.

    ``model`` replaces the one named by the config (tests share one loaded tokenizer); the
    gateway closes only a model it made itself. ``resolver`` looks up ``dns:///`` targets
    (tests inject one). With a ``registry`` the gateway's metrics are registered on it.
    """

    def __init__(
        self,
        config: GatewayConfig,
        model: ServedModel | None = None,
        *,
        resolver: Resolver = system_resolver,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.channels = ChannelCache()
        self._owns_model = model is None
        self.model = model or ServedModel(
            locate_model(config.model, config.model_cache_dir), config.max_model_len
        )
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
        )
        self.dispatcher = Dispatcher(self.router, self.channels, max_retries=config.max_retries)
        self.metrics = GatewayMetrics(registry) if registry is not None else None
        if registry is not None:
            registry.register(
                WorkersCollector(lambda: ((w.kind.value, w.up) for w in self.router.workers))
            )
        self.servicer = BatonServicer(self.model, self.dispatcher, self.metrics)

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
        )

    async def ready(self) -> None:
        """Load the tokenizer and wait for a decode worker, side by side."""
        self.router.start()
        logger.info(
            "gateway: loading %s; waiting for a decode worker of %s (prefill: %s)",
            self.model.source.name,
            ", ".join(self.config.decode),
            ", ".join(self.config.prefill) or "none, single-process workers",
        )
        await asyncio.gather(self.model.load(), self.router.wait_ready())

    async def aclose(self) -> None:
        await self.router.close()
        await self.channels.close()
        if self._owns_model:
            self.model.close()

    def _register(self, server: grpc.aio.Server) -> None:
        generate_pb2_grpc.add_BatonServicer_to_server(self.servicer, server)
