"""The sender machinery every backend shares: per-receiver lanes, cancel, peer links.

A backend supplies only ``_connect`` (open a ``PeerLink`` to one receiver incarnation)
and the link's ``send``. Each receiver address has its own lane: a queue and a thread
that creates, uses, probes and closes that address's link, so a receiver that stops
answering (a connect, a verdict, a stalled send, a probe of a vanished pod's address)
delays only the jobs to it, never those to other receivers. A link is dropped when a
descriptor names another incarnation at its address, when its receiver is gone
(``PeerLink.gone``, probed on the lane while idle, at growing intervals), or after
``peer_idle_s`` without a job, so a dead or departed decode worker's mapping or process
group never outlives it for long. Each job is a ``send`` span on the ``timeline``'s
``kv send`` track (engine.timeline; OFF unless the owner sets one before the first job).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.compute_thread import serial_torch_here
from engine.errors import (
    AbortedError,
    BatonError,
    CancelledError,
    DeadlineExceededError,
    LayoutMismatchError,
    UnavailableError,
    drop_frame_locals,
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
    """A sender's connection to one receiver incarnation. Used by its lane's thread only."""

    incarnation: str
    broken: bool = False  # set when the link must not be reused (the next job reconnects)

    @abstractmethod
    def send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        """Copy the job's blocks; return ``(checksum, bytes sent)``. Calls ``stop(g)``
        before each layer group and lets its error propagate (after keeping the wire
        consistent). Raises typed ``BatonError``s; blocks for at most the job deadline
        plus one stall timeout."""

    def gone(self) -> bool:
        """True once the receiver is known to have closed or died. May do a little
        bounded I/O; called on its lane's thread while the lane is idle. Never raises."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release the mapping / process group. Idempotent; never raises."""


# A lane probes its idle link for a departed receiver first this long after a job, then at
# doubling intervals up to _PROBE_MAX_S: a probe of a black-holed address costs its own
# lane up to the probe's timeout each time, and never any other lane.
_PROBE_FIRST_S = 1.0
_PROBE_MAX_S = 30.0


@dataclass(slots=True, eq=False)
class _Lane:
    """The jobs to one receiver address, and the link its thread holds to it."""

    address: str
    wake: threading.Condition  # on the sender's lock
    queue: deque[SendJob] = field(default_factory=deque)
    current: SendJob | None = None
    stop_reason: BatonError | None = None
    link: PeerLink | None = None  # opened, used and closed by the lane's thread alone
    last_used: float = 0.0


class QueuedSender(KVSender):
    """Runs ``SendJob``s on one worker thread per receiver address and reports
    ``SendCompletion``s: jobs to one address go in submission order, and a silent or
    slow receiver (a connect, a verdict, a stalled send, a probe) holds up only its own
    lane. A lane ends, closing its link, once it has no job and no usable link, after
    ``peer_idle_s`` without a job, or when its receiver is gone."""

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
        self._lock = threading.Lock()
        self._closing = False
        self._done: deque[SendCompletion] = deque()
        self._lanes: dict[str, _Lane] = {}
        self._threads: list[threading.Thread] = []  # every lane thread not yet joined
        self._groups_started = 0
        # Test seam: called on a lane before each layer group as (request_id, group).
        self._on_group: Callable[[str, int], None] | None = None

    # -- KVSender -------------------------------------------------------------------------

    def submit(self, job: SendJob) -> None:
        self._validate(job)
        address = job.descriptor.endpoint.address
        with self._lock:
            if self._closing:
                raise UnavailableError(f"request {job.request_id}: {self.kind} sender is closed")
            lane = self._lanes.get(address)
            if lane is None:
                lane = self._lanes[address] = self._start_lane(address)
            lane.queue.append(job)
            lane.wake.notify()
        logger.debug(
            "request %s: queued %d blocks for %s",
            job.request_id,
            len(job.src_block_ids),
            address,
        )

    def poll(self) -> list[SendCompletion]:
        with self._lock:
            out = list(self._done)
            self._done.clear()
        return out

    def cancel(self, request_id: str) -> None:
        dropped: list[SendJob] = []
        with self._lock:
            for lane in self._lanes.values():
                mine = [job for job in lane.queue if job.request_id == request_id]
                for job in mine:
                    lane.queue.remove(job)
                dropped += mine
                if lane.current is not None and lane.current.request_id == request_id:
                    lane.stop_reason = CancelledError(f"request {request_id}: transfer cancelled")
        for job in dropped:
            logger.info("request %s: queued transfer cancelled", request_id)
            self._complete(_failed(job, CancelledError(f"request {request_id}: cancelled")))

    def close(self) -> None:
        pending: list[SendJob] = []
        with self._lock:
            if not self._closing:
                self._closing = True
                for lane in self._lanes.values():
                    pending += lane.queue
                    lane.queue.clear()
                    if lane.current is not None:
                        lane.stop_reason = UnavailableError(
                            f"request {lane.current.request_id}: {self.kind} sender closed"
                        )
                    lane.wake.notify()
            threads = list(self._threads)
        for job in pending:
            error = UnavailableError(f"request {job.request_id}: {self.kind} sender closed")
            self._complete(_failed(job, error))
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    # -- backend hook -----------------------------------------------------------------------

    @abstractmethod
    def _connect(self, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        """Open a link to ``endpoint``'s receiver incarnation, checking its live layout and
        incarnation. Raises ``UnavailableError``, ``AbortedError`` (the receiver went
        silent), ``DeadlineExceededError`` (``deadline`` passed) or
        ``LayoutMismatchError``. Runs on the address's lane thread."""

    # -- lanes ------------------------------------------------------------------------------

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
        with self._lock:
            return sum(1 for lane in self._lanes.values() if lane.link is not None)

    def _start_lane(self, address: str) -> _Lane:
        """A new lane for ``address``, its thread started. Called with the lock held."""
        lane = _Lane(address, threading.Condition(self._lock), last_used=time.monotonic())
        thread = threading.Thread(
            target=self._run_lane,
            args=(lane,),
            daemon=True,
            name=f"baton-transfer-{self.kind}-sender",
        )
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()
        return lane

    def _run_lane(self, lane: _Lane) -> None:
        serial_torch_here()  # leave OpenMP's team to the compute thread
        first = min(_PROBE_FIRST_S, self.config.peer_idle_s / 4)
        interval = first
        next_probe = time.monotonic() + interval
        while True:
            step = self._next_step(lane, next_probe)
            if isinstance(step, SendJob):
                started = time.perf_counter_ns()
                completion = self._execute(lane, step)
                if self.timeline.enabled:
                    self.timeline.complete("send", SEND, started, _send_args(step, completion))
                with self._lock:
                    lane.current = None
                self._complete(completion)
                interval = first
                next_probe = time.monotonic() + interval
            elif step == "probe":
                assert lane.link is not None
                if lane.link.gone():
                    logger.info(
                        "%s sender %s: receiver %s at %s is gone; dropping its link",
                        self.kind,
                        self.incarnation,
                        lane.link.incarnation,
                        lane.address,
                    )
                    self._drop(lane)
                interval = min(interval * 2, _PROBE_MAX_S)
                next_probe = time.monotonic() + interval
            else:
                if step == "idle":
                    logger.info(
                        "%s sender %s: dropping idle link to %s (%.0f s without a job)",
                        self.kind,
                        self.incarnation,
                        lane.address,
                        time.monotonic() - lane.last_used,
                    )
                self._drop(lane)
                return

    def _next_step(self, lane: _Lane, next_probe: float) -> SendJob | str:
        """The lane's next job, or "probe" (its idle link is due a probe), or why it ends:
        "idle" (past ``peer_idle_s``) or "done" (closing, or nothing left to hold)."""
        with self._lock:
            while True:
                if lane.queue:
                    lane.current = lane.queue.popleft()
                    lane.stop_reason = None
                    return lane.current
                now = time.monotonic()
                idle = now - lane.last_used > self.config.peer_idle_s
                if self._closing or lane.link is None or idle:
                    # Retired under the lock: a job submitted from now on starts a new lane.
                    if self._lanes.get(lane.address) is lane:
                        del self._lanes[lane.address]
                    if idle and not self._closing and lane.link is not None:
                        return "idle"
                    return "done"
                if now >= next_probe:
                    return "probe"
                lane.wake.wait(min(next_probe, lane.last_used + self.config.peer_idle_s) - now)

    def _execute(self, lane: _Lane, job: SendJob) -> SendCompletion:
        endpoint = job.descriptor.endpoint
        start = time.monotonic()
        link: PeerLink | None = None
        try:
            self._check_stop(lane, job, -1)
            link = self._link_for(lane, endpoint, job.deadline)
            checksum, nbytes = link.send(job, lambda group: self._check_stop(lane, job, group))
        except BatonError as exc:
            logger.warning(
                "request %s: transfer to %s failed: %s", job.request_id, endpoint.address, exc
            )
            # The error travels to the request's handler and may sit in a reference cycle
            # until a full collection; its frames must not keep the link's process group
            # (and its threads and sockets) alive that long.
            drop_frame_locals(exc)
            return _failed(job, exc)
        except Exception as exc:  # a backend bug or torch error: report it typed, keep serving
            logger.exception("request %s: transfer to %s crashed", job.request_id, endpoint.address)
            if link is not None:
                link.broken = True
            return _failed(job, AbortedError(f"request {job.request_id}: transfer failed: {exc!r}"))
        finally:
            if link is not None and link.broken:
                self._drop(lane)
        seconds = time.monotonic() - start
        logger.debug(
            "request %s: sent %d bytes to %s in %.3f s",
            job.request_id,
            nbytes,
            endpoint.address,
            seconds,
        )
        return SendCompletion(job.request_id, job.descriptor.epoch, checksum, nbytes)

    def _link_for(self, lane: _Lane, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        link = lane.link
        if link is not None and link.incarnation != endpoint.incarnation:
            logger.info(
                "receiver at %s is now incarnation %s (was %s); dropping cached state",
                endpoint.address,
                endpoint.incarnation,
                link.incarnation,
            )
            self._drop(lane)
            link = None
        if link is None:
            link = self._connect(endpoint, deadline)
            with self._lock:
                lane.link = link
        lane.last_used = time.monotonic()
        return link

    def _drop(self, lane: _Lane) -> None:
        with self._lock:
            link, lane.link = lane.link, None
        if link is not None:
            link.close()

    @property
    def progress(self) -> int:
        return self._groups_started

    def _check_stop(self, lane: _Lane, job: SendJob, group: int) -> None:
        with self._lock:
            self._groups_started += 1  # lanes run in parallel: counted under the lock
        if self._on_group is not None:
            self._on_group(job.request_id, group)
        with self._lock:
            reason = lane.stop_reason
        if reason is not None:
            raise reason
        if time.monotonic() > job.deadline:
            raise DeadlineExceededError(f"request {job.request_id}: send deadline passed")

    def _complete(self, completion: SendCompletion) -> None:
        with self._lock:
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
