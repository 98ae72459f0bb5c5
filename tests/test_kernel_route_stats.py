"""The chosen CPU kernel routes travel from the engine through WorkerStats (field 15) to
the gateway's ``baton_cpu_kernel_route`` metric."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from engine.kernels.route_table import ROW_CLASSES
from engine.kv_layout import KVLayout
from engine.stats import EngineStats
from gateway.metrics import KernelRoutesCollector
from gateway.routing.workers import WorkerKind, WorkerState
from rpc import convert
from tests.engine_helpers import make_core

ROUTES = (("decode", "panels"), ("gemv", "gemv"), ("prefill", "onednn"))


def _stats(routes: tuple[tuple[str, str], ...]) -> EngineStats:
    return EngineStats(
        num_running=0, num_waiting=0, num_waiting_for_kv=0, num_total_blocks=8,
        num_free_blocks=8, num_held_blocks=0, num_queued_prompt_tokens=0,
        prefix_hit_tokens=0, prefix_query_tokens=0, num_preemptions=0, num_steps=0,
        busy_seconds=0.0, cpu_kernel_routes=routes,
    )  # fmt: skip


def test_routes_ride_in_worker_stats_and_reach_the_router() -> None:
    layout = KVLayout(2, 16, 2, 8, "float32")
    msg = convert.worker_stats_to_proto("decode", "inc", _stats(ROUTES), 0.0, layout)
    assert dict(msg.cpu_kernel_routes) == dict(ROUTES)
    state = WorkerState(address="10.0.0.1:50051", kind=WorkerKind.DECODE)
    state.update(msg)
    assert state.cpu_kernel_routes == dict(ROUTES)
    # A worker that reports none (GPU) clears what an earlier incarnation reported.
    state.update(convert.worker_stats_to_proto("decode", "inc2", _stats(()), 0.0, layout))
    assert state.cpu_kernel_routes == {}


def test_the_gateway_exports_one_series_per_worker_and_class() -> None:
    registry = CollectorRegistry()
    workers = [("10.0.0.1:50051", dict(ROUTES)), ("10.0.0.2:50051", {})]
    registry.register(KernelRoutesCollector(lambda: iter(workers)))
    text = generate_latest(registry).decode()
    for row_class, route in ROUTES:
        line = (
            f'baton_cpu_kernel_route{{route="{route}",row_class="{row_class}",'
            f'worker="10.0.0.1:50051"}} 1.0'
        )
        assert line in text, text
    assert "10.0.0.2" not in text


def test_engine_stats_report_every_row_class(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, cpu_kernels="default")
    routes = dict(core.stats().cpu_kernel_routes)
    assert set(routes) == set(ROW_CLASSES)
    assert routes == core.runner.kernel_routes.routes
