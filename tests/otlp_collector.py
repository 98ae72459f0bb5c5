"""A fake OpenTelemetry collector: the OTLP/gRPC trace service on 127.0.0.1 port 0, keeping
every span it is sent, so a test can check the traces of services running as processes
(started with ``--otlp-endpoint http://127.0.0.1:PORT``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc.aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True, slots=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    attributes: dict[str, object]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []

    async def Export(self, request, context):  # noqa: N802 (gRPC method name)
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        CollectedSpan(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            attributes={
                                a.key: getattr(a.value, a.value.WhichOneof("value"))
                                for a in s.attributes
                            },
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass(slots=True)
class Collector:
    endpoint: str  # what --otlp-endpoint takes
    service: _TraceService

    @property
    def spans(self) -> list[CollectedSpan]:
        return self.service.spans


@contextlib.asynccontextmanager
async def otlp_collector() -> AsyncIterator[Collector]:
    service = _TraceService()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Collector(endpoint=f"http://127.0.0.1:{port}", service=service)
    finally:
        await server.stop(0)
