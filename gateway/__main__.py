"""``python -m gateway``: run the gateway until SIGTERM (see gateway.config for the flags)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from gateway.app import Gateway
from gateway.config import GatewayConfig
from rpc.server import serve
from rpc.tracing import build_tracer_provider


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = GatewayConfig.from_args(sys.argv[1:] if argv is None else argv, os.environ)
    except ValueError as err:
        print(f"gateway: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_run(config))
    except ValueError as err:  # an unusable model or address, found at start-up
        logging.getLogger("gateway").error("gateway: %s", err)
        return 2
    return 0


async def _run(config: GatewayConfig) -> None:
    tracer_provider = build_tracer_provider("baton-gateway", config.otlp_endpoint)
    gateway = Gateway(config, tracer_provider=tracer_provider)
    try:
        await serve(gateway.spec())
    finally:
        await gateway.aclose()
        # Flushes the spans not yet exported; blocking, but only for the export timeout.
        await asyncio.to_thread(tracer_provider.shutdown)


if __name__ == "__main__":
    sys.exit(main())
