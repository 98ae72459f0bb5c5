"""Request traces: W3C ``traceparent`` across every hop, OpenTelemetry spans in each process.

Each service's ``__main__`` builds one :class:`TracerProvider` (:func:`build_tracer_provider`)
and passes it down; nothing here touches OpenTelemetry's global provider or propagator, so
tests can run several services, each with its own in-memory exporter, in one process.

The trace context crosses a hop as the W3C ``traceparent`` (and ``tracestate``) entries:
HTTP headers at the gateway's HTTP front end, gRPC metadata everywhere else (the keys are
the same lower-case strings). A missing or malformed ``traceparent`` starts a new trace, as
the W3C spec asks.

Spans are named ``role.phase`` and carry the request id (STYLE 23). :func:`span` starts one
without making it "current": async generators yield across tasks, where a context attached
in one step would leak into the caller, so parents are always passed explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

REQUEST_ID = "baton.request_id"  # the span attribute naming the request
CANCELLED = "baton.cancelled"  # set on a span whose work was cancelled

_PROPAGATOR = TraceContextTextMapPropagator()


def build_tracer_provider(service_name: str, otlp_endpoint: str | None = None) -> TracerProvider:
    """The provider of one process. Spans are exported over OTLP/gRPC to ``otlp_endpoint``
    (``http://host:4317`` plain, ``https://...`` TLS) when it is given, and dropped
    otherwise (the trace context still propagates). Call ``shutdown()`` on exit: it
    flushes the spans not yet exported."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider


def context_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> Context:
    """The trace context a caller sent in gRPC metadata (an empty context if none)."""
    carrier = {k.lower(): v for k, v in metadata or () if isinstance(v, str)}
    return _PROPAGATOR.extract(carrier)


def context_from_headers(headers: Mapping[str, str]) -> Context:
    """The trace context of an HTTP request's headers (an empty context if none)."""
    return _PROPAGATOR.extract({k.lower(): v for k, v in headers.items()})


def metadata_for(context: Context | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata entries that carry ``context`` to the callee (none for no context)."""
    if context is None:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return tuple(carrier.items())


def traceparent_of(context: Context | None) -> str | None:
    """The ``traceparent`` value for ``context``, for logs and response headers."""
    return dict(metadata_for(context)).get("traceparent")


@contextlib.contextmanager
def span(
    tracer: trace.Tracer,
    name: str,
    parent: Context | None,
    *,
    request_id: str | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
) -> Iterator[trace.Span]:
    """A span under ``parent``, ended on exit; an exception escaping the block is recorded
    on it (status ERROR) and re-raised. Being cancelled (the caller went away, or ended
    the stream on a stop string) is not a failure: the span gets ``baton.cancelled``.
    The span is never made current (see module doc)."""
    attributes = {REQUEST_ID: request_id} if request_id is not None else None
    s = tracer.start_span(name, context=parent, kind=kind, attributes=attributes)
    try:
        yield s
    except GeneratorExit:  # a consumer closed the stream early: not a failure
        raise
    except asyncio.CancelledError:
        s.set_attribute(CANCELLED, True)
        raise
    except BaseException as exc:
        s.record_exception(exc)
        s.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        s.end()


def record_span(
    tracer: trace.Tracer,
    name: str,
    parent: Context | None,
    start_ns: int,
    end_ns: int,
    *,
    request_id: str | None = None,
    error: BaseException | None = None,
) -> trace.Span:
    """A span for a phase measured elsewhere (e.g. by the engine thread), given its start
    and end in ``time.time_ns()`` units; ``error`` sets status ERROR. Already ended."""
    attributes = {REQUEST_ID: request_id} if request_id is not None else None
    s = tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    if error is not None:
        s.record_exception(error)
        s.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    s.end(end_time=max(start_ns, end_ns))
    return s


def child_context(s: trace.Span) -> Context:
    """A context whose current span is ``s``: the parent of spans started under it."""
    return trace.set_span_in_context(s)
