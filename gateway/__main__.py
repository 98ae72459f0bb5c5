"""``python -m gateway``: run the gateway until SIGTERM (see gateway.config for the flags).

``--check-config`` parses the flags and their environment twins, prints the resolved
configuration as JSON and exits (0), or prints the error and exits 2, starting nothing:
the chart tests run every rendered gateway command through it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.routing.discovery import Resolver, file_resolver, system_resolver
from rpc.metrics import metrics_endpoint, new_registry
from rpc.server import serve
from rpc.tracing import build_tracer_provider


def main(argv: Sequence[str] | None = None, *, resolver: Resolver = system_resolver) -> int:
    """Run the gateway; ``resolver`` looks up dns:/// targets unless ``--resolve-file``
    names a file to answer them from."""
    try:
        config, check_only = GatewayConfig.parse(sys.argv[1:] if argv is None else argv, os.environ)
    except ValueError as err:
        print(f"gateway: {err}", file=sys.stderr)
        return 2
    if check_only:
        print(config.describe())
        return 0
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.resolve_file is not None:
        resolver = file_resolver(config.resolve_file)
    try:
        asyncio.run(_run(config, resolver))
    except ValueError as err:  # an unusable model or address, found at start-up
        logging.getLogger("gateway").error("gateway: %s", err)
        return 2
    return 0


async def _run(config: GatewayConfig, resolver: Resolver) -> None:
    tracer_provider = build_tracer_provider("baton-gateway", config.otlp_endpoint)
    registry = new_registry()
    gateway = Gateway(config, tracer_provider=tracer_provider, resolver=resolver, registry=registry)
    try:
        with metrics_endpoint(registry, config.metrics_port, config.host):
            await serve(gateway.spec())
    finally:
        await gateway.aclose()
        # Flushes the spans not yet exported; blocking, but only for the export timeout.
        await asyncio.to_thread(tracer_provider.shutdown)


if __name__ == "__main__":
    sys.exit(main())
