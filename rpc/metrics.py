"""Prometheus metrics: the HTTP endpoint every service serves, and the workers' metrics.

Each process builds one ``CollectorRegistry`` in its ``__main__`` and passes it down;
nothing is registered on prometheus-client's global registry, so tests can run many
services in one process. Names follow Prometheus conventions (``baton_`` prefix, base
units, ``_total`` counters); the README maps each onto its vLLM counterpart.

Worker metrics are read, at scrape time, from *snapshot callables*: one returns the
latest :class:`WorkerSnapshot` (or None while the worker starts) without touching the
engine thread, the other the KV transfer counts (thread-safe, always current).
:class:`WorkerSampler` makes the first: a task on the worker's event loop that asks the
engine for its stats every ``interval_s`` and keeps the last answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_wsgi_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.stats import TRANSFER_SECONDS_BUCKETS, EngineStats, TransferStats

logger = logging.getLogger(__name__)


def new_registry() -> CollectorRegistry:
    """The one registry of a process (built in ``__main__``)."""
    return CollectorRegistry(auto_describe=True)


class MetricsEndpoint:
    """``GET /metrics`` over HTTP on its own daemon thread. ``close`` once (twice is harmless)."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"metrics port must be in [0, 65536), got {port}")
        self._server: WSGIServer | None
        self._thread: threading.Thread | None
        try:
            self._server, self._thread = start_wsgi_server(port, host, registry)
        except OSError as err:
            raise ValueError(f"cannot serve metrics on {host}:{port}: {err}") from err
        self.port: int = self._server.server_port
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


@contextlib.contextmanager
def metrics_endpoint(
    registry: CollectorRegistry, port: int, host: str = "0.0.0.0"
) -> Iterator[MetricsEndpoint | None]:
    """An endpoint on ``port`` for the ``with`` block; None (nothing served) when 0."""
    if port == 0:
        yield None
        return
    endpoint = MetricsEndpoint(registry, port, host)
    try:
        yield endpoint
    finally:
        endpoint.close()


# --- workers --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """What a worker's metrics show at one moment."""

    engine: EngineStats
    # Share of wall time with a forward in flight over the last sampling window.
    busy_ratio: float


class WorkerCollector(Collector):
    """The worker metrics, from ``snapshot()``, ``transfers()`` (None: this worker moves
    no KV, or not yet), ``quarantined()`` and ``transfer_up()`` (None: it receives no KV,
    or not yet) at every scrape. ``role`` labels them all."""

    def __init__(
        self,
        role: str,
        snapshot: Callable[[], WorkerSnapshot | None],
        transfers: Callable[[], TransferStats | None] = lambda: None,
        quarantined: Callable[[], int | None] = lambda: None,
        transfer_up: Callable[[], bool | None] = lambda: None,
    ) -> None:
        self._role = role
        self._snapshot = snapshot
        self._transfers = transfers
        self._quarantined = quarantined
        self._transfer_up = transfer_up

    def describe(self) -> list[Metric]:
        return []  # names are only known from a snapshot; nothing to check up front

    def collect(self) -> Iterator[Metric]:
        transfers = self._transfers()
        if transfers is not None:
            yield from _transfer_metrics(self._role, transfers)
        quarantined = self._quarantined()
        if quarantined is not None:
            leases = GaugeMetricFamily(
                "baton_kv_quarantined_leases",
                "Ended KV leases whose blocks a stalled but live prefill writer still "
                "claims, kept out of use until it lets go or dies.",
                labels=["role"],
            )
            leases.add_metric([self._role], quarantined)
            yield leases
        up = self._transfer_up()
        if up is not None:
            thread = GaugeMetricFamily(
                "baton_kv_transfer_thread_up",
                "1 while the KV transfer worker thread runs; 0 once it died (every "
                "pending hand-off then failed with UNAVAILABLE and health is NOT_SERVING).",
                labels=["role"],
            )
            thread.add_metric([self._role], 1.0 if up else 0.0)
            yield thread
        snap = self._snapshot()
        if snap is None:
            return
        s = snap.engine
        role = [self._role]

        def gauge(name: str, doc: str, value: float) -> Metric:
            metric = GaugeMetricFamily(name, doc, labels=["role"])
            metric.add_metric(role, value)
            return metric

        def counter(name: str, doc: str, value: float) -> Metric:
            metric = CounterMetricFamily(name, doc, labels=["role"])
            metric.add_metric(role, value)
            return metric

        used = s.num_total_blocks - s.num_free_blocks
        yield gauge("baton_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("baton_requests_waiting", "Requests queued for a seat.", s.num_waiting)
        yield gauge(
            "baton_requests_waiting_for_kv",
            "Requests whose KV blocks are reserved and being filled by a prefill worker.",
            s.num_waiting_for_kv,
        )
        yield gauge("baton_kv_blocks_used", "KV blocks allocated (incl. held).", used)
        yield gauge("baton_kv_blocks_total", "KV blocks in the pool.", s.num_total_blocks)
        yield gauge(
            "baton_kv_blocks_held",
            "KV blocks of finished prefills kept until decode acknowledged their transfer.",
            s.num_held_blocks,
        )
        yield gauge(
            "baton_kv_cache_usage_ratio",
            "Share of the KV pool in use, 0 to 1.",
            used / s.num_total_blocks if s.num_total_blocks else 0.0,
        )
        yield gauge(
            "baton_queued_prompt_tokens",
            "Prompt tokens admitted but not yet computed (the prefill scaling signal).",
            s.num_queued_prompt_tokens,
        )
        yield gauge(
            "baton_engine_busy_ratio",
            "Share of wall time with a forward pass in flight, over the last sampling window.",
            snap.busy_ratio,
        )
        yield counter(
            "baton_engine_busy_seconds_total",
            "Wall time with a forward pass in flight.",
            s.busy_seconds,
        )
        yield counter("baton_engine_steps_total", "Engine steps run.", s.num_steps)
        yield counter(
            "baton_cpu_borrowed_forwards_total",
            "Forwards run on the cores of idle workers beside this one, with its own or "
            "instead of them while a co-owner computes there (--core-seat).",
            s.borrowed_forwards,
        )
        yield counter(
            "baton_cpu_core_wait_seconds_total",
            "Time this worker waited for its lent cores to come back before a forward.",
            s.core_wait_seconds,
        )
        yield gauge(
            "baton_attention_fallback",
            "1 when this GPU worker's Triton attention kernels did not build and it serves "
            "on the slower plain-torch path (--attention-fallback torch); else 0.",
            1.0 if s.attention_fallback else 0.0,
        )
        yield counter(
            "baton_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_query_tokens,
        )
        yield counter(
            "baton_prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache.",
            s.prefix_hit_tokens,
        )
        yield counter(
            "baton_preemptions_total", "Requests preempted (by recompute).", s.num_preemptions
        )
        yield counter(
            "baton_prompt_tokens_total",
            "Prompt tokens of requests admitted here.",
            s.num_prompt_tokens_total,
        )
        yield counter(
            "baton_generation_tokens_total",
            "Tokens sampled here.",
            s.num_generated_tokens_total,
        )


def _transfer_metrics(role: str, t: TransferStats) -> Iterator[Metric]:
    seconds = HistogramMetricFamily(
        "baton_kv_transfer_seconds",
        "Duration of KV hand-offs (prefill: queued to sent; decode: leased to verified).",
        labels=["role"],
    )
    bounds = [str(b) for b in TRANSFER_SECONDS_BUCKETS] + ["+Inf"]
    seconds.add_metric(
        [role], list(zip(bounds, t.seconds_buckets, strict=True)), sum_value=t.seconds_sum
    )
    yield seconds
    moved = CounterMetricFamily(
        "baton_kv_transfer_bytes_total",
        "Bytes of KV moved by completed hand-offs.",
        labels=["role"],
    )
    moved.add_metric([role], t.num_bytes)
    yield moved
    saved = CounterMetricFamily(
        "baton_kv_transfer_saved_bytes_total",
        "Bytes of KV completed hand-offs did not move because the receiving decode "
        "worker's prefix cache held the prompt's first blocks.",
        labels=["role"],
    )
    saved.add_metric([role], t.num_saved_bytes)
    yield saved
    failures = CounterMetricFamily(
        "baton_kv_transfer_failures_total",
        "KV hand-offs that failed, by reason.",
        labels=["role", "reason"],
    )
    for reason, count in sorted(t.failures.items()):
        failures.add_metric([role, reason], count)
    yield failures


class WorkerSampler:
    """Keeps the latest :class:`WorkerSnapshot` of a worker; run it on the worker's loop.

    ``stats`` asks the engine for its stats, at once (``AsyncEngine.stats``, its
    published snapshot) or awaitable; None while it starts. ``snapshot`` may be called
    from any thread.
    """

    def __init__(
        self,
        stats: Callable[[], EngineStats | Awaitable[EngineStats] | None],
        *,
        interval_s: float = 1.0,
        window_s: float = 10.0,
    ) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= window_s, got {interval_s}, {window_s}")
        self._stats = stats
        self._interval_s = interval_s
        self._window_s = window_s
        self._latest: WorkerSnapshot | None = None
        self._history: list[tuple[float, float]] = []  # (monotonic time, busy seconds)

    def snapshot(self) -> WorkerSnapshot | None:
        return self._latest

    async def sample(self) -> None:
        """Take one sample now (``run`` does this every ``interval_s``)."""
        pending = self._stats()
        if pending is None:
            return
        stats = await pending if inspect.isawaitable(pending) else pending
        now = time.monotonic()
        self._history.append((now, stats.busy_seconds))
        while len(self._history) > 2 and now - self._history[1][0] >= self._window_s:
            self._history.pop(0)
        then, busy_then = self._history[0]
        ratio = (stats.busy_seconds - busy_then) / (now - then) if now > then else 0.0
        self._latest = WorkerSnapshot(stats, min(1.0, max(0.0, ratio)))

    async def run(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as exc:  # a stopping engine; the next sample may work
                logger.debug("metrics sample failed: %s", exc)
            await asyncio.sleep(self._interval_s)
