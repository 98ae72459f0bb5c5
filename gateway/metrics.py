"""The gateway's Prometheus metrics: requests by final status, latencies, streams in
flight, requests moved between decode workers, the workers the router sees up, prompt
tokens routed on the cache, and the CPU kernel each worker runs.

Registered on the registry ``__main__`` builds (see rpc.metrics). Histogram buckets are
vLLM's, so dashboards of the two read alike: TTFT from 1 ms to 43 min, inter-token
latency from 10 ms to 80 s, end-to-end latency from 0.3 s to 2 h.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.routing.migration import MoveReason
from rpc.errors import status_for

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class GatewayMetrics:
    """One per gateway. ``track`` a request for its whole life."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "baton_requests",
            "Generate calls by final gRPC status (OK, CANCELLED, UNAVAILABLE, ...).",
            ["status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "baton_time_to_first_token_seconds",
            "From the call's arrival to its first token leaving the gateway.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "baton_inter_token_latency_seconds",
            "Between consecutive tokens of one stream (per token of a multi-token delta).",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "baton_e2e_request_latency_seconds",
            "From the call's arrival to its end, whatever the status.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.migrations = Counter(
            "baton_request_migrations",
            "Requests moved to another decode worker mid-stream, by why its worker "
            "let go of it (worker_gone, draining, broken_stream).",
            ["reason"],
            registry=registry,
        )
        for reason in MoveReason:
            self.migrations.labels(reason=reason.value)
        self.in_flight = Gauge(
            "baton_streams_in_flight",
            "Generate streams open now (the gateway scaling signal).",
            registry=registry,
        )

    def track(self, began: float | None = None) -> RequestTrack:
        return RequestTrack(self, time.monotonic() if began is None else began)


class RequestTrack:
    """One request's timings: ``tokens`` per delta sent, ``finish`` once with how it ended."""

    __slots__ = ("_m", "_began", "_last", "_done")

    def __init__(self, metrics: GatewayMetrics, began: float) -> None:
        self._m = metrics
        self._began = began
        self._last: float | None = None  # when the previous token left
        self._done = False
        metrics.in_flight.inc()

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.observe(now - self._began)
            count -= 1
        else:
            gap = (now - self._last) / count
            for _ in range(count):
                self._m.itl.observe(gap)
            count = 0
        if count:  # the first delta carried more than one token: they arrived together
            for _ in range(count):
                self._m.itl.observe(0.0)
        self._last = now

    def moved(self, reason: MoveReason) -> None:
        self._m.migrations.labels(reason=reason.value).inc()

    def finish(self, error: BaseException | None) -> None:
        """Record the final status: OK, the code ``error`` maps to, or CANCELLED."""
        if self._done:
            return
        self._done = True
        self._m.in_flight.dec()
        self._m.e2e.observe(time.monotonic() - self._began)
        self._m.requests.labels(status=final_status(error)).inc()


def final_status(error: BaseException | None) -> str:
    if error is None:
        return grpc.StatusCode.OK.name
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        return grpc.StatusCode.CANCELLED.name  # the client went away or its deadline passed
    return status_for(error)[0].name


class WorkersCollector(Collector):
    """``baton_workers_up{kind}`` and ``baton_workers_known{kind}`` from the router."""

    def __init__(self, workers: Callable[[], Iterator[tuple[str, bool]]]) -> None:
        # Yields (kind, up) of every known worker. Called on the metrics thread: it must
        # take its copy of the router's state in one step (a tuple() of a dict's values).
        self._workers = workers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("baton_workers_up", "Workers routed to now.", labels=["kind"])
        known = GaugeMetricFamily(
            "baton_workers_known", "Workers discovered (up or not).", labels=["kind"]
        )
        counts: dict[str, list[int]] = {"decode": [0, 0], "prefill": [0, 0]}
        for kind, is_up in self._workers():
            counts.setdefault(kind, [0, 0])
            counts[kind][0] += int(is_up)
            counts[kind][1] += 1
        for kind, (n_up, n_known) in sorted(counts.items()):
            up.add_metric([kind], n_up)
            known.add_metric([kind], n_known)
        yield up
        yield known


class RoutingCollector(Collector):
    """``baton_routed_prompt_tokens_total`` and ``baton_routed_cached_prompt_tokens_total``:
    prompt tokens routed with cache-aware routing, and of those the ones the chosen worker
    already held (their ratio is the routing's prefix hit rate); ``baton_prefills_total
    {where}``: where disaggregated prompts were prefilled."""

    def __init__(self, counts: Callable[[], tuple[int, int, int, int]]) -> None:
        # (routed, cached, local prefills, remote prefills), read on the metrics thread
        self._counts = counts

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        routed, cached, local, remote = self._counts()
        where = CounterMetricFamily(
            "baton_prefills",
            "Prompts routed in disaggregated mode, by where they were prefilled: on a "
            "prefill worker (remote) or on the decode worker itself (local: conditional "
            "disaggregation).",
            labels=["where"],
        )
        where.add_metric(["local"], local)
        where.add_metric(["remote"], remote)
        yield where
        yield CounterMetricFamily(
            "baton_routed_prompt_tokens",
            "Prompt tokens routed by cache-aware routing (--routing kv).",
            value=routed,
        )
        yield CounterMetricFamily(
            "baton_routed_cached_prompt_tokens",
            "Of those, the tokens the chosen worker held in its prefix cache.",
            value=cached,
        )


class KernelRoutesCollector(Collector):
    """``baton_cpu_kernel_route{worker,row_class,route} 1``: the kernel each worker runs
    each class of its linear layers on (``engine.kernels.route_table``), from its Stats.
    Bounded: a few row classes per worker."""

    def __init__(self, workers: Callable[[], Iterator[tuple[str, dict[str, str]]]]) -> None:
        # Yields (address, row class -> route) of every known worker; called on the
        # metrics thread, so it must copy the router's state in one step.
        self._workers = workers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "baton_cpu_kernel_route",
            "1 for the kernel route each worker runs each linear row class on (CPU).",
            labels=["worker", "row_class", "route"],
        )
        for worker, routes in self._workers():
            for row_class, route in sorted(routes.items()):
                family.add_metric([worker, row_class, route], 1)
        yield family
