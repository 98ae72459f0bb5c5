"""Snapshots of an engine's load and KV occupancy, and of its KV transfers, as workers
report them (Stats RPC, Prometheus metrics). Torch-free."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    LayoutMismatchError,
    UnavailableError,
)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_total_blocks: int
    num_free_blocks: int
    num_held_blocks: int
    num_queued_prompt_tokens: int
    prefix_hit_tokens: int  # since start, like the counters below
    prefix_query_tokens: int
    num_preemptions: int
    num_steps: int
    busy_seconds: float
    # Prompt tokens of requests admitted (run here, or reserved for KV from a prefill
    # worker) and tokens sampled here, since start.
    num_prompt_tokens_total: int = 0
    num_generated_tokens_total: int = 0
    # The scheduler's bounds: requests admitted at once, and queued beyond those.
    max_num_seqs: int = 0
    max_queued_requests: int = 0
    # CPU: the kernel route of each linear row class (engine.kernels.route_table);
    # fixed at start-up, empty on GPU.
    cpu_kernel_routes: tuple[tuple[str, str], ...] = ()
    # GPU: the Triton kernels did not build and --attention-fallback torch chose the
    # plain-torch runner.
    attention_fallback: bool = False
    # CPU, workers planned on one host (engine.core_lending): forwards run on a team
    # widened by idle neighbours' cores, and time spent waiting for a lent share to come
    # back, since start.
    borrowed_forwards: int = 0
    core_wait_seconds: float = 0.0
    # The core group this worker borrows in (engine.core_lending.core_group); "": none.
    core_group: str = ""


# Upper bounds (seconds) of the KV transfer duration histogram: a few blocks over shm
# take well under a millisecond, a long prompt over gloo between hosts seconds.
TRANSFER_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# Failure reasons, by error class (most specific first): a small fixed set, so a metric
# label stays bounded.
_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (LayoutMismatchError, "layout_mismatch"),
    (DeadlineExceededError, "deadline_exceeded"),
    (TimeoutError, "deadline_exceeded"),
    (CancelledError, "cancelled"),
    (AbortedError, "aborted"),
    (UnavailableError, "unavailable"),
)


def failure_reason(error: BaseException) -> str:
    """The metric label of a failed transfer: one of a fixed set, "other" for the rest."""
    for cls, reason in _REASONS:
        if isinstance(error, cls):
            return reason
    return "other"


@dataclass(frozen=True, slots=True)
class TransferStats:
    """KV transfers of one side (prefill: sends; decode: leases) since start."""

    num_ok: int = 0
    num_bytes: int = 0  # bytes moved by transfers that completed
    # Decode: bytes those transfers did not move because this worker's prefix cache
    # held the prompt's first blocks.
    num_saved_bytes: int = 0
    seconds_sum: float = 0.0  # over every transfer, failed ones too
    # Cumulative counts per TRANSFER_SECONDS_BUCKETS bound (``le``), then +Inf.
    seconds_buckets: tuple[int, ...] = (0,) * (len(TRANSFER_SECONDS_BUCKETS) + 1)
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count

    @property
    def num_transfers(self) -> int:
        return self.seconds_buckets[-1]


class TransferTally:
    """Counts KV transfers as they end; ``snapshot`` from any thread.

    ``record`` is called by whoever sees completions (on the event loop); the metrics
    endpoint reads ``snapshot`` from its own thread, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_ok = 0
        self._num_bytes = 0
        self._num_saved_bytes = 0
        self._seconds_sum = 0.0
        self._buckets = [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1)
        self._failures: dict[str, int] = {}

    def record(
        self,
        seconds: float,
        num_bytes: int,
        error: BaseException | None,
        *,
        saved_bytes: int = 0,
    ) -> None:
        with self._lock:
            self._seconds_sum += seconds
            for i, bound in enumerate(TRANSFER_SECONDS_BUCKETS):
                if seconds <= bound:
                    self._buckets[i] += 1
            self._buckets[-1] += 1
            if error is None:
                self._num_ok += 1
                self._num_bytes += num_bytes
                self._num_saved_bytes += saved_bytes
            else:
                reason = failure_reason(error)
                self._failures[reason] = self._failures.get(reason, 0) + 1

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(
                num_ok=self._num_ok,
                num_bytes=self._num_bytes,
                num_saved_bytes=self._num_saved_bytes,
                seconds_sum=self._seconds_sum,
                seconds_buckets=tuple(self._buckets),
                failures=dict(self._failures),
            )
