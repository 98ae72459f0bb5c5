"""One connected trace per request across the three services, and the request's timings.

In one process: a real prefill worker and a real decode worker (tiny model, shm) behind
real gRPC servers, and a gateway, each with its own in-memory span exporter, as three
processes would each have their own provider. A request that carries a ``traceparent``
must come back as one trace: the gateway's spans under the caller's, decode's under
``gateway.stream`` (the ``Decode`` call's metadata), prefill's under ``decode.wait_kv``
(the ``Prefill`` call's metadata). Its last message carries every phase's timing. A
single-process worker records one ``decode.generate`` span and the phases that happen.

Through real processes (``tiny_cluster``), ``--otlp-endpoint`` on every service exports
the same tree to a fake OTLP collector, the final HTTP chunk carries ``baton_timings``,
and the gateway logs the timings in the request's one finish line.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import openai
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from decode_service.servicer import SERVICE_NAME as DECODE_SERVICE
from decode_service.servicer import DecodeServicer
from engine.config import EngineConfig
from gateway.app import Gateway
from gateway.config import GatewayConfig
from gateway.served_model import ServedModel
from prefill_service.servicer import SERVICE_NAME as PREFILL_SERVICE
from prefill_service.servicer import PrefillServicer
from protos.baton.v1 import common_pb2, generate_pb2_grpc, worker_pb2_grpc
from rpc.server import RpcServer, ServerSpec
from rpc.tracing import REQUEST_ID
from rpc.worker_config import WorkerConfig
from tests.e2e_helpers import ids_request, prompt_ids, tiny_cluster
from tests.fake_workers import eventually
from tests.otlp_collector import CollectedSpan, otlp_collector

pytestmark = pytest.mark.asyncio(loop_scope="module")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
# span -> its parent, for one disaggregated request (None: the caller's span).
TREE = {
    "gateway.request": None,
    "gateway.validate": "gateway.request",
    "gateway.tokenize": "gateway.request",
    "gateway.stream": "gateway.request",
    "gateway.route": "gateway.stream",
    "decode.reserve": "gateway.stream",
    "decode.wait_kv": "gateway.stream",
    "decode.decode": "gateway.stream",
    "prefill.queue": "decode.wait_kv",
    "prefill.prefill": "decode.wait_kv",
    "prefill.transfer": "decode.wait_kv",
}
PHASES = (
    "queued_s",
    "reserved_s",
    "prefill_s",
    "transfer_s",
    "first_token_s",
    "decode_s",
    "total_s",
)


def _exporter() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@dataclass(slots=True)
class Services:
    stub: generate_pb2_grpc.BatonStub
    exporters: dict[str, InMemorySpanExporter]  # by service: gateway, decode, prefill


def _worker_config(role: str, model: Path) -> WorkerConfig:
    engine = EngineConfig(model=str(model), dtype="float32", num_blocks=64, num_threads=1)
    extra = {"transport_address": f"baton-tr-{uuid.uuid4().hex[:16]}"} if role != "prefill" else {}
    return WorkerConfig(role=role, engine=engine, transport="shm", grace_s=0.0, **extra)


async def _serve(name: str, service: str, register, ready) -> RpcServer:  # noqa: ANN001
    server = RpcServer(
        ServerSpec(name=name, register=register, service_names=(service,), ready=ready, grace_s=0)
    )
    await server.start()
    await server.wait_ready()
    return server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def services(tiny_llama: Path, served_smollm2: ServedModel) -> AsyncIterator[Services]:
    providers = {name: _exporter() for name in ("gateway", "decode", "prefill")}
    prefill = PrefillServicer(
        _worker_config("prefill", tiny_llama), tracer_provider=providers["prefill"][0]
    )
    decode = DecodeServicer(
        _worker_config("decode", tiny_llama), tracer_provider=providers["decode"][0]
    )
    servers: list[RpcServer] = []
    gateway: Gateway | None = None
    try:
        servers.append(
            await _serve(
                "prefill",
                PREFILL_SERVICE,
                lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, s),
                prefill.start,
            )
        )
        servers.append(
            await _serve(
                "decode",
                DECODE_SERVICE,
                lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, s),
                decode.start,
            )
        )
        config = GatewayConfig(
            decode=(f"127.0.0.1:{servers[1].port}",),
            prefill=(f"127.0.0.1:{servers[0].port}",),
            port=0,
            max_retries=0,
            grace_s=0.0,
            local_prefill_tokens=0,  # the hand-off's spans and phases are under test
            stats_interval_s=0.05,
            stats_timeout_s=0.5,
        )
        gateway = Gateway(config, model=served_smollm2, tracer_provider=providers["gateway"][0])
        servers.append(RpcServer(gateway.spec()))
        await servers[-1].start()
        await servers[-1].wait_ready()
        await eventually(lambda: all(w.up for w in gateway.router.workers))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[-1].port}") as channel:
            yield Services(
                generate_pb2_grpc.BatonStub(channel),
                {name: exporter for name, (_, exporter) in providers.items()},
            )
    finally:
        for server in reversed(servers):
            await server.stop()
        if gateway is not None:
            await gateway.aclose()
        await decode.close()
        await prefill.close()


def _named(spans: Sequence[ReadableSpan]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), sorted(s.name for s in spans)
    return named


def _of_request(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


async def test_one_connected_trace_across_gateway_decode_and_prefill(services: Services) -> None:
    request = ids_request(40, "trace-1", max_tokens=5, request_id="r-trace")
    got = [
        r async for r in services.stub.Generate(request, metadata=(("traceparent", TRACEPARENT),))
    ]
    assert sum(len(r.token_ids) for r in got) == 5
    trace_id = int(TRACE_ID, 16)
    counts = {"gateway": 5, "decode": 3, "prefill": 3}

    def all_ended() -> bool:
        return all(
            len(_of_request(services.exporters[name], trace_id)) == n for name, n in counts.items()
        )

    await eventually(all_ended)
    by_service = {name: _named(_of_request(e, trace_id)) for name, e in services.exporters.items()}
    assert {n.split(".")[0] for n in by_service["decode"]} == {"decode"}
    assert {n.split(".")[0] for n in by_service["prefill"]} == {"prefill"}
    named = {**by_service["gateway"], **by_service["decode"], **by_service["prefill"]}
    assert set(named) == set(TREE)
    for child, parent in TREE.items():
        s = named[child]
        assert s.parent is not None, child
        expected = int(CALLER_SPAN, 16) if parent is None else named[parent].context.span_id
        assert s.parent.span_id == expected, f"{child} should hang under {parent}"
    # Gateway spans name the client's request id; a worker's, the attempt id its logs use.
    for name, s in named.items():
        rid = s.attributes[REQUEST_ID]
        assert rid == "r-trace" or rid.startswith("r-trace#"), (name, rid)
    # Phases happen in order: prefill's queue, then its prefill, then the transfer, all
    # inside decode's wait for the KV, which comes after the reservation.
    assert named["prefill.queue"].end_time <= named["prefill.prefill"].start_time + 1
    assert named["prefill.prefill"].end_time <= named["prefill.transfer"].start_time
    assert named["decode.reserve"].end_time <= named["decode.wait_kv"].start_time
    assert named["decode.wait_kv"].start_time <= named["prefill.queue"].start_time
    assert named["prefill.transfer"].end_time <= named["decode.wait_kv"].end_time
    assert named["decode.wait_kv"].end_time <= named["decode.decode"].start_time


async def test_the_last_message_carries_every_phase(services: Services) -> None:
    request = ids_request(40, "timings-1", max_tokens=4, request_id="r-timings")
    got = [r async for r in services.stub.Generate(request)]
    assert all(not r.HasField("timings") for r in got[:-1])
    timings = got[-1].timings
    values = {name: getattr(timings, name) for name in PHASES if timings.HasField(name)}
    assert set(values) == set(PHASES), timings
    assert all(v >= 0 for v in values.values())
    before_first = values["queued_s"] + values["prefill_s"] + values["transfer_s"]
    assert values["reserved_s"] + before_first <= values["first_token_s"] <= values["total_s"]
    assert values["first_token_s"] + values["decode_s"] == pytest.approx(values["total_s"])


async def test_a_request_the_gateway_ends_still_has_the_workers_phases(
    services: Services,
) -> None:
    """A stop string: the gateway ends the request, decode's last message never comes,
    yet the workers' phases (from decode's first message) are there."""
    # What the model says greedily, and a stop string in the middle of it.
    probe = ids_request(24, "stop-1", max_tokens=12)
    text = "".join([r.text async for r in services.stub.Generate(probe)])
    assert len(text) >= 4
    request = ids_request(24, "stop-1", max_tokens=12)
    request.stop.append(text[len(text) // 2 : len(text) // 2 + 2])
    got = [r async for r in services.stub.Generate(request)]
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    timings = got[-1].timings
    for name in ("reserved_s", "queued_s", "prefill_s", "transfer_s", "decode_s", "total_s"):
        assert timings.HasField(name), name


# --- real processes, OTLP ------------------------------------------------------------


def _tree_of(spans: list[CollectedSpan]) -> dict[str, CollectedSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), sorted(s.name for s in spans)
    return named


async def test_three_processes_export_one_trace_over_otlp(tiny_llama: Path) -> None:
    async with otlp_collector() as collector:
        otlp = ("--otlp-endpoint", collector.endpoint)
        cm = tiny_cluster(tiny_llama, worker_args=otlp, gateway_args=otlp, http_port=0)
        cluster = await asyncio.to_thread(cm.__enter__)
        try:
            client = openai.AsyncOpenAI(
                base_url=f"http://{cluster.http_address}/v1", api_key="-", max_retries=0
            )
            async with client:
                (model,) = (await client.models.list()).data
                stream = await client.completions.create(
                    model=model.id,
                    prompt=prompt_ids(30, "otlp-1"),
                    max_tokens=4,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                    extra_headers={"traceparent": TRACEPARENT, "X-Request-Id": "r-otlp"},
                )
                chunks = [chunk async for chunk in stream]
            (gateway,) = [p for p in cluster.procs if p.kind == "gateway"]
            logs = gateway.log.read_text(errors="replace")
        finally:
            await asyncio.to_thread(cm.__exit__, None, None, None)  # SIGTERM flushes spans
    assert all("baton_timings" not in (c.model_extra or {}) for c in chunks[:-1])
    timings = (chunks[-1].model_extra or {})["baton_timings"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert set(timings) == set(PHASES), chunks[-1]
    finish_lines = [line for line in logs.splitlines() if "request r-otlp: finished" in line]
    assert len(finish_lines) == 1, logs
    for phase in ("queued=", "reserved=", "prefill=", "transfer=", "first_token=", "decode="):
        assert phase in finish_lines[0] and f"{phase}-" not in finish_lines[0], finish_lines[0]

    ours = [s for s in collector.spans if s.trace_id == TRACE_ID]
    named = _tree_of(ours)
    assert set(named) == set(TREE), sorted(named)
    services = {s.name.split(".")[0]: s.service for s in ours}
    assert services == {
        "gateway": "baton-gateway",
        "decode": "baton-decode",
        "prefill": "baton-prefill",
    }
    for child, parent in TREE.items():
        expected = CALLER_SPAN if parent is None else named[parent].span_id
        assert named[child].parent_span_id == expected, f"{child} should hang under {parent}"


async def test_single_process_worker_one_span_and_its_phases(
    tiny_llama: Path, served_smollm2: ServedModel
) -> None:
    provider, exporter = _exporter()
    worker = DecodeServicer(_worker_config("both", tiny_llama), tracer_provider=provider)
    servers: list[RpcServer] = []
    gateway: Gateway | None = None
    try:
        servers.append(
            await _serve(
                "worker",
                DECODE_SERVICE,
                lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(worker, s),
                worker.start,
            )
        )
        config = GatewayConfig(
            decode=(f"127.0.0.1:{servers[0].port}",),
            port=0,
            max_retries=0,
            grace_s=0.0,
            stats_interval_s=0.05,
            stats_timeout_s=0.5,
        )
        gateway = Gateway(config, model=served_smollm2)
        servers.append(RpcServer(gateway.spec()))
        await servers[-1].start()
        await servers[-1].wait_ready()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[-1].port}") as channel:
            stub = generate_pb2_grpc.BatonStub(channel)
            request = ids_request(20, "single-1", max_tokens=3, request_id="r-single")
            got = [
                r async for r in stub.Generate(request, metadata=(("traceparent", TRACEPARENT),))
            ]
    finally:
        for server in reversed(servers):
            await server.stop()
        if gateway is not None:
            await gateway.aclose()
        await worker.close()
    timings = got[-1].timings
    known = {name for name in PHASES if timings.HasField(name)}
    assert known == set(PHASES) - {"reserved_s", "transfer_s"}
    (s,) = exporter.get_finished_spans()
    assert s.name == "decode.generate" and s.context.trace_id == int(TRACE_ID, 16)
    assert s.attributes[REQUEST_ID].startswith("r-single#")
