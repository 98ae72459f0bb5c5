"""``python -m rpc.probe``: one ``grpc.health.v1`` Check, for probes that cannot speak TLS.

Kubernetes' built-in gRPC probe dials plaintext, so it cannot reach a worker whose port
requires mTLS. An exec probe runs this instead, inside the pod, with the pod's own
certificate::

    python -m rpc.probe --address 127.0.0.1:50051 \\
        --tls-cert /tls/tls.crt --tls-key /tls/tls.key --tls-ca /tls/ca.crt

Exit status 0 when the server reports SERVING, 1 when it answers anything else or cannot
be reached in time, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc.tls import TlsFiles, server_name_option


def probe(
    address: str,
    tls: TlsFiles | None = None,
    server_name: str | None = None,
    timeout_s: float = 2.0,
    service: str = "",
) -> bool:
    """True when ``address`` reports SERVING for ``service`` ("" = the whole server)."""
    material = tls.load() if tls is not None else None
    options = list(server_name_option(server_name))
    channel = (
        grpc.insecure_channel(address, options=options)
        if material is None
        else grpc.secure_channel(address, material.channel_credentials(), options=options)
    )
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rpc.probe", description=__doc__.split("\n")[0])
    p.add_argument("--address", required=True, help="host:port of the server")
    p.add_argument("--tls-cert", type=Path, help="client certificate (PEM), for mTLS")
    p.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    p.add_argument("--tls-ca", type=Path, help="CA bundle (PEM) the server's certificate is from")
    p.add_argument("--tls-server-name", help="name the server's certificate is checked against")
    p.add_argument("--service", default="", help="health service name; '' is the server")
    p.add_argument("--timeout-s", type=float, default=2.0, help="deadline of the check")
    args = p.parse_args(argv)
    tls = None
    if args.tls_cert or args.tls_key or args.tls_ca:
        try:
            tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
            tls.load()
        except ValueError as err:
            print(f"rpc.probe: {err}", file=sys.stderr)
            return 2
    serving = probe(args.address, tls, args.tls_server_name, args.timeout_s, args.service)
    if not serving:
        print(f"rpc.probe: {args.address} is not SERVING", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
