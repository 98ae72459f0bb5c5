"""Prometheus metrics: the worker collectors read snapshots, the transfer tally, the busy
window, the HTTP endpoint, and the gateway's request metrics over a real gateway.

Every test builds its own registry: nothing touches prometheus-client's global one, so
two services (or two tests) in one process never collide.
"""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import errors
from engine.sampling_params import SamplingParams
from engine.stats import (
    TRANSFER_SECONDS_BUCKETS,
    EngineStats,
    TransferStats,
    TransferTally,
    failure_reason,
)
from gateway.metrics import GatewayMetrics, final_status
from rpc.metrics import MetricsEndpoint, WorkerCollector, WorkerSampler, WorkerSnapshot
from tests.engine_helpers import make_core


def engine_stats(**fields: float) -> EngineStats:
    base: dict[str, float] = {
        "num_running": 3,
        "num_waiting": 2,
        "num_waiting_for_kv": 1,
        "num_total_blocks": 100,
        "num_free_blocks": 60,
        "num_held_blocks": 4,
        "num_queued_prompt_tokens": 700,
        "prefix_hit_tokens": 32,
        "prefix_query_tokens": 128,
        "num_preemptions": 5,
        "num_steps": 40,
        "busy_seconds": 12.5,
        "num_prompt_tokens_total": 900,
        "num_generated_tokens_total": 77,
        "borrowed_forwards": 6,
        "core_wait_seconds": 0.75,
    }
    base.update(fields)
    return EngineStats(**base)  # type: ignore[arg-type]


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of everything the registry exposes."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_worker_collector_exposes_every_worker_metric_from_the_snapshot() -> None:
    tally = TransferTally()
    tally.record(0.004, 4096, None)
    tally.record(0.2, 8192, None)
    tally.record(3.0, 0, errors.DeadlineExceededError("slow"))
    tally.record(0.01, 0, errors.AbortedError("checksum"))
    snapshot: list[WorkerSnapshot | None] = [None]
    moved: list[TransferStats | None] = [None]
    quarantined: list[int | None] = [None]
    registry = CollectorRegistry()
    registry.register(
        WorkerCollector("decode", lambda: snapshot[0], lambda: moved[0], lambda: quarantined[0])
    )
    assert samples(registry) == {}  # nothing while the worker starts
    snapshot[0] = WorkerSnapshot(engine_stats(), busy_ratio=0.25)
    moved[0] = tally.snapshot()
    quarantined[0] = 2
    got = samples(registry)
    role = (("role", "decode"),)
    expected = {
        "baton_requests_running": 3,
        "baton_requests_waiting": 2,
        "baton_requests_waiting_for_kv": 1,
        "baton_kv_blocks_used": 40,
        "baton_kv_blocks_total": 100,
        "baton_kv_blocks_held": 4,
        "baton_kv_cache_usage_ratio": 0.4,
        "baton_queued_prompt_tokens": 700,
        "baton_engine_busy_ratio": 0.25,
        "baton_engine_busy_seconds_total": 12.5,
        "baton_engine_steps_total": 40,
        "baton_cpu_borrowed_forwards_total": 6,
        "baton_cpu_core_wait_seconds_total": 0.75,
        "baton_attention_fallback": 0,
        "baton_prefix_cache_queries_total": 128,
        "baton_prefix_cache_hits_total": 32,
        "baton_preemptions_total": 5,
        "baton_prompt_tokens_total": 900,
        "baton_generation_tokens_total": 77,
        "baton_kv_transfer_bytes_total": 4096 + 8192,
        "baton_kv_transfer_seconds_count": 4,
        "baton_kv_quarantined_leases": 2,
    }
    for name, value in expected.items():
        assert got[(name, role)] == pytest.approx(value), name
    assert got[("baton_kv_transfer_seconds_sum", role)] == pytest.approx(3.214)
    assert got[("baton_kv_transfer_seconds_bucket", (("le", "0.005"), *role))] == 1
    assert got[("baton_kv_transfer_seconds_bucket", (("le", "0.25"), *role))] == 3
    assert got[("baton_kv_transfer_seconds_bucket", (("le", "+Inf"), *role))] == 4
    failures = {k[1]: v for k, v in got.items() if k[0] == "baton_kv_transfer_failures_total"}
    assert failures == {
        (("reason", "aborted"), *role): 1,
        (("reason", "deadline_exceeded"), *role): 1,
    }


def test_an_attention_fallback_shows_on_the_worker_metrics() -> None:
    snapshot = WorkerSnapshot(
        dataclasses.replace(engine_stats(), attention_fallback=True), busy_ratio=0.0
    )
    registry = CollectorRegistry()
    registry.register(WorkerCollector("prefill", lambda: snapshot))
    assert samples(registry)[("baton_attention_fallback", (("role", "prefill"),))] == 1


def test_a_dead_transfer_thread_shows_on_the_worker_metrics() -> None:
    up: list[bool | None] = [None]
    registry = CollectorRegistry()
    registry.register(WorkerCollector("decode", lambda: None, transfer_up=lambda: up[0]))
    name = ("baton_kv_transfer_thread_up", (("role", "decode"),))
    assert name not in samples(registry)  # no receiver (yet): no series
    up[0] = True
    assert samples(registry)[name] == 1
    up[0] = False
    assert samples(registry)[name] == 0


def test_failure_reasons_are_a_small_fixed_set() -> None:
    assert failure_reason(errors.LayoutMismatchError("x")) == "layout_mismatch"
    assert failure_reason(errors.UnavailableError("x")) == "unavailable"
    assert failure_reason(errors.CancelledError("x")) == "cancelled"
    assert failure_reason(TimeoutError()) == "deadline_exceeded"
    assert failure_reason(RuntimeError("torch exploded")) == "other"
    assert len(TransferTally().snapshot().seconds_buckets) == len(TRANSFER_SECONDS_BUCKETS) + 1


async def test_sampler_reports_the_busy_share_of_its_window() -> None:
    busy = [0.0]

    async def stats() -> EngineStats:
        return engine_stats(busy_seconds=busy[0])

    sampler = WorkerSampler(stats, interval_s=0.05, window_s=0.5)
    assert sampler.snapshot() is None
    await sampler.sample()
    await asyncio.sleep(0.2)
    busy[0] = 0.1  # busy for half of the 0.2 s that passed
    await sampler.sample()
    snap = sampler.snapshot()
    assert snap is not None
    assert snap.busy_ratio == pytest.approx(0.5, abs=0.15)
    idle = WorkerSampler(lambda: None)
    await idle.sample()  # an engine still starting: no snapshot, no error
    assert idle.snapshot() is None


async def test_sampler_takes_the_engines_snapshot_as_it_is_answered() -> None:
    """AsyncEngine.stats answers at once (its published snapshot), not an awaitable: the
    workers' __main__ hands it over like that, and the metrics must still show."""
    sampler = WorkerSampler(lambda: engine_stats(num_running=7))
    await sampler.sample()
    snap = sampler.snapshot()
    assert snap is not None and snap.engine.num_running == 7


def test_engine_counts_prompt_and_generated_tokens(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, num_blocks=64)
    core.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=3, ignore_eos=True))
    stats = core.stats()
    assert stats.num_prompt_tokens_total == 6
    assert stats.num_generated_tokens_total == 6
    assert stats.prefix_query_tokens >= 6


def test_endpoint_serves_its_own_registry_and_closes() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    GatewayMetrics(first).requests.labels(status="OK").inc()
    GatewayMetrics(second)  # the same names again: no clash, each registry is its own
    endpoint = MetricsEndpoint(first, port=0, host="127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics").read().decode()
    finally:
        endpoint.close()
        endpoint.close()
    assert 'baton_requests_total{status="OK"} 1.0' in body
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=1)


def test_request_track_observes_ttft_itl_and_status() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    track = metrics.track()
    assert samples(registry)[("baton_streams_in_flight", ())] == 1
    track.tokens(1)
    track.tokens(3)
    track.tokens(0)
    track.finish(None)
    track.finish(errors.UnavailableError("twice is ignored"))
    failed = metrics.track()
    failed.finish(errors.UnavailableError("no decode worker is up"))
    got = samples(registry)
    assert got[("baton_streams_in_flight", ())] == 0
    assert got[("baton_time_to_first_token_seconds_count", ())] == 1
    assert got[("baton_inter_token_latency_seconds_count", ())] == 3
    assert got[("baton_e2e_request_latency_seconds_count", ())] == 2
    assert got[("baton_requests_total", (("status", "OK"),))] == 1
    assert got[("baton_requests_total", (("status", "UNAVAILABLE"),))] == 1


def test_final_status_of_cancellation_and_bad_input() -> None:
    assert final_status(asyncio.CancelledError()) == "CANCELLED"
    assert final_status(GeneratorExit()) == "CANCELLED"
    assert final_status(ValueError("max_tokens")) == "INVALID_ARGUMENT"
    assert final_status(errors.ResourceExhaustedError("kv")) == "RESOURCE_EXHAUSTED"
