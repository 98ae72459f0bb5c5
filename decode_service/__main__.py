"""``python -m decode_service``: run a decode worker (or, with --single-process, a worker
that runs prefill and decode in one engine) until SIGTERM. Flags: rpc.worker_config.

``--check-config`` parses the flags and their environment twins, prints the resolved
configuration as JSON and exits (0), or prints the error and exits 2, starting nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

from protos.baton.v1 import worker_pb2_grpc
from rpc.metrics import WorkerCollector, WorkerSampler, metrics_endpoint, new_registry
from rpc.server import ServerSpec, serve
from rpc.tracing import build_tracer_provider
from rpc.worker_config import WorkerConfig, WorkerSecurity, env_prefix
from rpc.worker_cpus import settle_cpus


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    single = "--single-process" in args or os.environ.get(
        env_prefix("decode") + "SINGLE_PROCESS", ""
    ).lower() in ("1", "true", "yes", "on")
    try:
        cfg, check_only = WorkerConfig.parse("both" if single else "decode", args, os.environ)
    except ValueError as err:
        print(f"decode_service: {err}", file=sys.stderr)
        return 2
    if check_only:
        print(cfg.describe())
        return 0
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        # Before torch is imported: its OpenMP team starts inside the pinned mask.
        cfg = settle_cpus(cfg)
    except ValueError as err:
        print(f"decode_service: {err}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_run(cfg))
    except ValueError as err:
        logging.getLogger("decode_service").error("decode_service: %s", err)
        return 2
    return 0


async def _run(cfg: WorkerConfig) -> None:
    # Imported here, so that --check-config answers without loading torch.
    from decode_service.servicer import SERVICE_NAME, DecodeServicer

    security = WorkerSecurity.load(cfg)
    tracer_provider = build_tracer_provider(
        "baton-decode" if cfg.role == "decode" else "baton-worker", cfg.otlp_endpoint
    )
    servicer = DecodeServicer(
        cfg, tls=security.tls, fleet_key=security.fleet_key, tracer_provider=tracer_provider
    )
    spec = ServerSpec(
        name="decode" if cfg.role == "decode" else "worker",
        register=lambda server: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
            servicer, server
        ),
        service_names=(SERVICE_NAME,),
        host=cfg.host,
        port=cfg.port,
        ready=servicer.start,
        grace_s=cfg.grace_s,
        port_file=cfg.port_file,
        fatal=servicer.fatal,
        liveness=servicer.stalled,
        on_stop=servicer.drain,
        credentials=security.server_credentials(),
        reflection=cfg.enable_reflection,
    )
    registry = new_registry()
    sampler = WorkerSampler(
        lambda: servicer.engine.stats() if servicer.engine is not None else None
    )
    registry.register(
        WorkerCollector(
            cfg.role,
            sampler.snapshot,
            lambda: servicer.inbox.tally.snapshot() if servicer.inbox is not None else None,
            lambda: servicer.inbox.num_quarantined if servicer.inbox is not None else None,
            lambda: servicer.inbox.worker_up if servicer.inbox is not None else None,
        )
    )
    sampling = None  # the sampler asks the engine for stats: only when someone reads them
    if cfg.metrics_port:
        sampling = asyncio.create_task(sampler.run(), name="metrics-sampler")
    try:
        with metrics_endpoint(registry, cfg.metrics_port, cfg.host):
            await serve(spec)
    finally:
        if sampling is not None:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
        await servicer.close()
        # Flushes the spans not yet exported; blocking, but only for the export timeout.
        await asyncio.to_thread(tracer_provider.shutdown)


if __name__ == "__main__":
    sys.exit(main())
