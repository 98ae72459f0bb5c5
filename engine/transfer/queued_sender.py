"""The sender machinery every backend shares: job queue, worker thread, cancel, peer cache.

A backend supplies only ``_connect`` (open a ``PeerLink`` to one receiver incarnation)
and the link's ``send``. Links are created, used and closed on the worker thread alone.
A link is dropped when a descriptor names another incarnation at its address, when its
receiver is gone (``PeerLink.gone``), or after ``peer_idle_s`` without a job, so a dead
or departed decode worker's mapping or process group never outlives it for long.
Each job is a ``send`` span on the ``timeline``'s ``kv send`` track (engine.timeline;
OFF unless the owner sets one before the first job).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable

import torch

from engine.compute_thread import serial_torch_here
from engine.errors import (
    AbortedError,
    BatonError,
    CancelledError,
    DeadlineExceededError,
    LayoutMismatchError,
    UnavailableError,
)
from engine.kv_layout import BLOCK_DIM, KVLayout
from engine.timeline import SEND
from engine.transfer.base import (
    KVEndpoint,
    KVSender,
    Notify,
    SendCompletion,
    SendJob,
    TransferConfig,
)
from engine.transfer.block_copy import torch_dtype

logger = logging.getLogger(__name__)

# Called before layer group ``g`` (or -1 before connecting); raises a BatonError to stop.
StopCheck = Callable[[int], None]


class PeerLink(ABC):
    """A sender's connection to one receiver incarnation. Used by one thread only."""

    incarnation: str
    broken: bool = False  # set when the link must not be reused (the next job reconnects)

    @abstractmethod
    def send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        """Copy the job's blocks; return ``(checksum, bytes sent)``. Calls ``stop(g)``
        before each layer group and lets its error propagate (after keeping the wire
        consistent). Raises typed ``BatonError``s; blocks for at most the job deadline
        plus one stall timeout."""

    def gone(self) -> bool:
        """True once the receiver is known to have closed or died. May do a little I/O;
        called on the worker thread between jobs. Never raises."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release the mapping / process group. Idempotent; never raises."""


class QueuedSender(KVSender):
    """Runs ``SendJob``s in order on one worker thread and reports ``SendCompletion``s."""

    kind = ""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: TransferConfig | None = None,
        notify: Notify | None = None,
    ) -> None:
        num_blocks = int(kv_cache.shape[BLOCK_DIM]) if kv_cache.dim() == 6 else 0
        expected = layout.pool_shape(num_blocks) if num_blocks else None
        if expected is None or tuple(kv_cache.shape) != expected:
            raise ValueError(
                f"kv_cache shape {tuple(kv_cache.shape)} does not match layout {layout}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous (one tensor over the whole pool)")
        if kv_cache.dtype != torch_dtype(layout):
            raise ValueError(
                f"kv_cache dtype {kv_cache.dtype} does not match layout dtype {layout.dtype}"
            )
        self.incarnation = uuid.uuid4().hex
        self.kv_cache = kv_cache
        self.layout = layout
        self.num_blocks = num_blocks
        self.config = config or TransferConfig()
        self._notify = notify
        self._cond = threading.Condition()
        self._queue: deque[SendJob] = deque()
        self._current: SendJob | None = None
        self._stop_reason: BatonError | None = None
        self._closing = False
        self._done: deque[SendCompletion] = deque()
        self._links: dict[str, PeerLink] = {}
        self._last_used: dict[str, float] = {}
        self._groups_started = 0
        # Test seam: called on the worker before each layer group as (request_id, group).
        self._on_group: Callable[[str, int], None] | None = None
        self._worker = threading.Thread(
            target=self._run, name=f"baton-transfer-{self.kind}-sender", daemon=True
        )
        self._worker.start()

    # -- KVSender -------------------------------------------------------------------------

    def submit(self, job: SendJob) -> None:
        self._validate(job)
        with self._cond:
            if self._closing:
                raise UnavailableError(f"request {job.request_id}: {self.kind} sender is closed")
            self._queue.append(job)
            self._cond.notify()
        logger.debug(
            "request %s: queued %d blocks for %s",
            job.request_id,
            len(job.src_block_ids),
            job.descriptor.endpoint.address,
        )

    def poll(self) -> list[SendCompletion]:
        with self._cond:
            out = list(self._done)
            self._done.clear()
        return out

    def cancel(self, request_id: str) -> None:
        with self._cond:
            dropped = [job for job in self._queue if job.request_id == request_id]
            for job in dropped:
                self._queue.remove(job)
            if self._current is not None and self._current.request_id == request_id:
                self._stop_reason = CancelledError(f"request {request_id}: transfer cancelled")
        for job in dropped:
            logger.info("request %s: queued transfer cancelled", request_id)
            self._complete(_failed(job, CancelledError(f"request {request_id}: cancelled")))

    def close(self) -> None:
        with self._cond:
            if self._closing:
                pending: list[SendJob] = []
            else:
                self._closing = True
                pending = list(self._queue)
                self._queue.clear()
                if self._current is not None:
                    self._stop_reason = UnavailableError(
                        f"request {self._current.request_id}: {self.kind} sender closed"
                    )
                self._cond.notify_all()
        for job in pending:
            error = UnavailableError(f"request {job.request_id}: {self.kind} sender closed")
            self._complete(_failed(job, error))
        if threading.current_thread() is not self._worker:
            self._worker.join()

    # -- backend hook -----------------------------------------------------------------------

    @abstractmethod
    def _connect(self, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        """Open a link to ``endpoint``'s receiver incarnation, checking its live layout and
        incarnation. Raises ``UnavailableError``, ``DeadlineExceededError`` or
        ``LayoutMismatchError``. Runs on the worker thread."""

    # -- worker -----------------------------------------------------------------------------

    def _validate(self, job: SendJob) -> None:
        desc = job.descriptor
        endpoint = desc.endpoint
        if endpoint.kind != self.kind:
            raise ValueError(f"descriptor kind {endpoint.kind!r} sent to a {self.kind!r} sender")
        if job.request_id != desc.request_id:
            raise ValueError(
                f"job request id {job.request_id!r} != descriptor request id {desc.request_id!r}"
            )
        if not job.src_block_ids or len(job.src_block_ids) != len(desc.block_ids):
            raise ValueError(
                f"request {job.request_id}: {len(job.src_block_ids)} source blocks for "
                f"{len(desc.block_ids)} destination blocks (must be equal and non-zero)"
            )
        bad_src = [b for b in job.src_block_ids if not 0 <= b < self.num_blocks]
        if bad_src:
            raise ValueError(
                f"request {job.request_id}: source blocks {bad_src} outside [0, {self.num_blocks})"
            )
        bad_dst = [b for b in desc.block_ids if not 0 <= b < endpoint.num_blocks]
        if bad_dst or len(set(desc.block_ids)) != len(desc.block_ids):
            raise ValueError(
                f"request {job.request_id}: destination blocks {desc.block_ids} "
                f"repeat or leave [0, {endpoint.num_blocks})"
            )
        diff = self.layout.mismatch(endpoint.layout)
        if diff is not None:
            raise LayoutMismatchError(
                f"request {job.request_id}: receiver {endpoint.address} KV layout differs "
                f"from ours ({diff})"
            )

    @property
    def num_links(self) -> int:
        """Receivers this sender holds state for (mapped pools, process groups)."""
        with self._cond:
            return len(self._links)

    def _run(self) -> None:
        serial_torch_here()  # leave OpenMP's team to the compute thread
        reap_every = min(1.0, self.config.peer_idle_s / 4)
        next_reap = time.monotonic() + reap_every
        while True:
            if time.monotonic() >= next_reap:
                self._reap_links()
                next_reap = time.monotonic() + reap_every
            with self._cond:
                while not self._queue and not self._closing:
                    wait = next_reap - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                if not self._queue:
                    if self._closing:
                        break
                    continue  # time to reap
                job = self._queue.popleft()
                self._current = job
                self._stop_reason = None
            started = time.perf_counter_ns()
            completion = self._execute(job)
            if self.timeline.enabled:
                self.timeline.complete("send", SEND, started, _send_args(job, completion))
            with self._cond:
                self._current = None
            self._complete(completion)
        with self._cond:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()

    def _execute(self, job: SendJob) -> SendCompletion:
        endpoint = job.descriptor.endpoint
        start = time.monotonic()
        link: PeerLink | None = None
        try:
            self._check_stop(job, -1)
            link = self._link_for(endpoint, job.deadline)
            checksum, nbytes = link.send(job, lambda group: self._check_stop(job, group))
        except BatonError as exc:
            logger.warning(
                "request %s: transfer to %s failed: %s", job.request_id, endpoint.address, exc
            )
            return _failed(job, exc)
        except Exception as exc:  # a backend bug or torch error: report it typed, keep serving
            logger.exception("request %s: transfer to %s crashed", job.request_id, endpoint.address)
            if link is not None:
                link.broken = True
            return _failed(job, AbortedError(f"request {job.request_id}: transfer failed: {exc!r}"))
        finally:
            if link is not None and link.broken:
                self._drop(endpoint.address)
        seconds = time.monotonic() - start
        logger.debug(
            "request %s: sent %d bytes to %s in %.3f s",
            job.request_id,
            nbytes,
            endpoint.address,
            seconds,
        )
        return SendCompletion(job.request_id, job.descriptor.epoch, checksum, nbytes)

    def _link_for(self, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        link = self._links.get(endpoint.address)
        if link is not None and link.incarnation != endpoint.incarnation:
            logger.info(
                "receiver at %s is now incarnation %s (was %s); dropping cached state",
                endpoint.address,
                endpoint.incarnation,
                link.incarnation,
            )
            self._drop(endpoint.address)
            link = None
        if link is None:
            link = self._connect(endpoint, deadline)
            with self._cond:
                self._links[endpoint.address] = link
        self._last_used[endpoint.address] = time.monotonic()
        return link

    def _drop(self, address: str) -> None:
        with self._cond:
            link = self._links.pop(address, None)
        self._last_used.pop(address, None)
        if link is not None:
            link.close()

    def _reap_links(self) -> None:
        """Drop links to receivers that are gone or idle past ``peer_idle_s``."""
        now = time.monotonic()
        for address, link in list(self._links.items()):
            idle = now - self._last_used.get(address, now)
            if idle > self.config.peer_idle_s:
                logger.info(
                    "%s sender %s: dropping idle link to %s (%.0f s without a job)",
                    self.kind,
                    self.incarnation,
                    address,
                    idle,
                )
                self._drop(address)
            elif link.gone():
                logger.info(
                    "%s sender %s: receiver %s at %s is gone; dropping its link",
                    self.kind,
                    self.incarnation,
                    link.incarnation,
                    address,
                )
                self._drop(address)

    @property
    def progress(self) -> int:
        return self._groups_started

    def _check_stop(self, job: SendJob, group: int) -> None:
        self._groups_started += 1  # one writer thread: a plain int is enough
        if self._on_group is not None:
            self._on_group(job.request_id, group)
        with self._cond:
            reason = self._stop_reason
        if reason is not None:
            raise reason
        if time.monotonic() > job.deadline:
            raise DeadlineExceededError(f"request {job.request_id}: send deadline passed")

    def _complete(self, completion: SendCompletion) -> None:
        with self._cond:
            self._done.append(completion)
        if self._notify is not None:
            self._notify()


def _send_args(job: SendJob, completion: SendCompletion) -> dict[str, object]:
    args: dict[str, object] = {
        "request_id": job.request_id,
        "blocks": len(job.src_block_ids),
        "bytes": completion.num_bytes,
    }
    if completion.error is not None:
        args["error"] = type(completion.error).__name__
    return args


def _failed(job: SendJob, error: BatonError) -> SendCompletion:
    return SendCompletion(job.request_id, job.descriptor.epoch, None, 0, error)
