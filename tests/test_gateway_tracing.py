"""Gateway request traces: the caller's W3C ``traceparent`` (HTTP header or gRPC metadata)
is the parent of the gateway's spans, or a new trace starts at the gateway; the spans
(``gateway.request`` > ``gateway.validate``, ``gateway.tokenize``, ``gateway.stream`` >
``gateway.route``) carry the request id; the ``Decode`` call carries the trace on to
decode; and ``python -m gateway --otlp-endpoint`` exports them over OTLP.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc.aio
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gateway.served_model import ServedModel
from protos.baton.v1 import generate_pb2, generate_pb2_grpc
from rpc.tracing import REQUEST_ID
from tests.fake_workers import FakeDecodeWorker, eventually, fake_workers
from tests.http_helpers import MODEL, post, running_http
from tests.otlp_collector import otlp_collector

REPO = Path(__file__).resolve().parent.parent
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
GATEWAY_SPANS = {
    "gateway.request",
    "gateway.validate",
    "gateway.tokenize",
    "gateway.stream",
    "gateway.route",
}


def in_memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def hex_id(value: int, digits: int) -> str:
    return f"{value:0{digits}x}"


def assert_one_connected_trace(
    spans: Sequence[ReadableSpan], rid: str, decode_metadata: dict[str, str], caller: str | None
) -> str:
    """The gateway's five spans form one tree (under ``caller``'s span if given) and hand
    ``gateway.stream`` to decode as the parent; returns the trace id."""
    named = by_name(spans)
    assert set(named) == GATEWAY_SPANS
    trace_ids = {s.context.trace_id for s in spans}
    assert len(trace_ids) == 1
    root = named["gateway.request"]
    assert (root.parent.span_id if root.parent else None) == (
        None if caller is None else int(caller, 16)
    )
    parent_of = {
        "gateway.validate": "gateway.request",
        "gateway.tokenize": "gateway.request",
        "gateway.stream": "gateway.request",
        "gateway.route": "gateway.stream",
    }
    for child, parent in parent_of.items():
        assert named[child].parent is not None
        assert named[child].parent.span_id == named[parent].context.span_id, child
    for s in spans:
        assert s.attributes[REQUEST_ID] == rid, s.name
    trace_id = hex_id(root.context.trace_id, 32)
    stream_id = hex_id(named["gateway.stream"].context.span_id, 16)
    version, sent_trace, sent_parent, flags = decode_metadata["traceparent"].split("-")
    assert (version, sent_trace, sent_parent) == ("00", trace_id, stream_id)
    assert int(flags, 16) & 1  # sampled
    return trace_id


async def test_http_traceparent_is_the_parent_of_the_gateway_spans(
    served_smollm2: ServedModel,
) -> None:
    provider, exporter = in_memory()
    decode = FakeDecodeWorker()
    async with (
        fake_workers([decode]) as (d, _),
        running_http(served_smollm2, d, tracer_provider=provider) as gw,
    ):
        status, _, _ = await post(
            gw.port,
            "/v1/completions",
            {"model": MODEL, "prompt": "hi"},
            traceparent=TRACEPARENT,
            X_Request_Id="r-http",
        )
        assert status == 200
        await eventually(lambda: len(exporter.get_finished_spans()) == len(GATEWAY_SPANS))
    spans = exporter.get_finished_spans()
    trace_id = assert_one_connected_trace(spans, "r-http", decode.metadata["r-http"], CALLER_SPAN)
    assert trace_id == TRACE_ID
    root = by_name(spans)["gateway.request"]
    assert root.attributes["baton.api"] == "openai.completions"
    assert by_name(spans)["gateway.route"].attributes["baton.decode"] == d[0].address


async def test_grpc_traceparent_is_the_parent_of_the_gateway_spans(
    served_smollm2: ServedModel,
) -> None:
    provider, exporter = in_memory()
    decode = FakeDecodeWorker()
    async with (
        fake_workers([decode]) as (d, _),
        running_http(served_smollm2, d, tracer_provider=provider) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.server.port}") as channel,
    ):
        stub = generate_pb2_grpc.BatonStub(channel)
        request = generate_pb2.GenerateRequest(text="hi", request_id="r-grpc")
        got = [r async for r in stub.Generate(request, metadata=(("traceparent", TRACEPARENT),))]
        assert got[-1].finish_reason
        await eventually(lambda: len(exporter.get_finished_spans()) == len(GATEWAY_SPANS))
    spans = exporter.get_finished_spans()
    trace_id = assert_one_connected_trace(spans, "r-grpc", decode.metadata["r-grpc"], CALLER_SPAN)
    assert trace_id == TRACE_ID
    assert by_name(spans)["gateway.request"].attributes["baton.api"] == "grpc.Generate"


@pytest.mark.parametrize("traceparent", [None, "00-not-a-valid-header"])
async def test_a_new_trace_starts_at_the_gateway_without_a_valid_traceparent(
    served_smollm2: ServedModel, traceparent: str | None
) -> None:
    provider, exporter = in_memory()
    decode = FakeDecodeWorker()
    headers = {"X_Request_Id": "r-new"} | ({"traceparent": traceparent} if traceparent else {})
    async with (
        fake_workers([decode]) as (d, _),
        running_http(served_smollm2, d, tracer_provider=provider) as gw,
    ):
        status, _, _ = await post(
            gw.port,
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            **headers,
        )
        assert status == 200
        await eventually(lambda: len(exporter.get_finished_spans()) == len(GATEWAY_SPANS))
    trace_id = assert_one_connected_trace(
        exporter.get_finished_spans(), "r-new", decode.metadata["r-new"], None
    )
    assert trace_id != TRACE_ID


async def test_a_refused_request_is_an_error_span(served_smollm2: ServedModel) -> None:
    provider, exporter = in_memory()
    async with (
        fake_workers([FakeDecodeWorker()]) as (d, _),
        running_http(served_smollm2, d, tracer_provider=provider) as gw,
    ):
        status, _, _ = await post(
            gw.port, "/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 2}
        )
        assert status == 400
        await eventually(lambda: len(exporter.get_finished_spans()) == 2)
    named = by_name(exporter.get_finished_spans())
    assert set(named) == {"gateway.request", "gateway.validate"}
    assert named["gateway.validate"].status.status_code is StatusCode.ERROR
    assert named["gateway.request"].status.status_code is StatusCode.ERROR


async def test_python_m_gateway_exports_spans_over_otlp(tmp_path: Path) -> None:
    decode = FakeDecodeWorker()
    http_port_file = tmp_path / "http.port"
    async with otlp_collector() as collector, fake_workers([decode]) as (d, _):
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "--decode",
            d[0].address,
            "--port",
            "0",
            "--http-port",
            "0",
            "--http-port-file",
            str(http_port_file),
            "--otlp-endpoint",
            collector.endpoint,
            "--stats-interval-s",
            "0.1",
            "--grace-s",
            "2",
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:

            def written() -> bool:
                assert process.returncode is None, "the gateway exited early"
                return http_port_file.exists() and http_port_file.read_text().endswith("\n")

            await eventually(written, timeout=120)
            port = int(http_port_file.read_text())

            async def answered() -> bool:
                status, _, _ = await post(
                    port,
                    "/v1/completions",
                    {"model": MODEL, "prompt": "hi"},
                    traceparent=TRACEPARENT,
                    X_Request_Id="r-otlp",
                )
                return status == 200

            await eventually(answered, timeout=120)  # 503 until the gateway is ready
            process.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(process.communicate(), 60)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 0, stderr.decode()[-3000:]
    ours = [s for s in collector.spans if s.attributes.get(REQUEST_ID) == "r-otlp"]
    assert {s.name for s in ours} == GATEWAY_SPANS, collector.spans
    assert {(s.service, s.trace_id) for s in ours} == {("baton-gateway", TRACE_ID)}
    root = next(s for s in ours if s.name == "gateway.request")
    assert root.parent_span_id == CALLER_SPAN
    stream = next(s for s in ours if s.name == "gateway.stream")
    assert decode.metadata["r-otlp"]["traceparent"].startswith(f"00-{TRACE_ID}-{stream.span_id}-")
