"""The receiver machinery every backend shares: block leases, their deadlines and endings.

A lease lives from ``expect`` to its one completion. Ending it (verified, cancelled,
expired, closed) is always the same three steps on the worker thread: revoke it so no
new write can start, wait until no peer is mid-write, then (for a verify) recompute the
checksum and queue the completion. A backend says how to revoke, how to tell that
writers are idle and when the data has arrived. Each lease (granted to ended) and its
checksum ``verify`` are spans on the ``timeline``'s ``kv receive`` track
(engine.timeline; OFF unless the owner sets one before the first lease).

If the worker thread dies (anything it raises: EMFILE in a liveness check, an OOM in a
verify), its last act ends every pending lease with ``UnavailableError``, after the same
revoke and (bounded, as on ``close``) drain; from then on ``expect`` refuses, ``failure``
names the cause and ``notify`` has told the owner, who must stop serving.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass

import torch

from engine.compute_thread import serial_torch_here
from engine.errors import (
    AbortedError,
    BatonError,
    CancelledError,
    UnavailableError,
)
from engine.kv_layout import KVLayout
from engine.timeline import RECEIVE
from engine.transfer.base import (
    KVDescriptor,
    KVEndpoint,
    KVReceiver,
    Notify,
    RecvCompletion,
    TransferConfig,
)
from engine.transfer.block_copy import HostPool, Staging, checksum_blocks

logger = logging.getLogger(__name__)

_IDLE_WAKE_S = 0.2  # the worker's longest sleep with nothing due
_DRAIN_POLL_S = 0.001  # how often a revoked lease re-checks for writers still at work
# Past the drain bound a lease waits on a stalled writer: check it (and whether it died)
# less often.
_QUARANTINE_POLL_S = 0.05
_HOUSEKEEPING_S = 1.0
# How long ``close`` waits for a peer mid-write before it tears the pool down anyway.
_CLOSE_DRAIN_S = 2.0


@dataclass(slots=True)
class Lease:
    """One request's grant on destination blocks. Guarded by the receiver's lock."""

    request_id: str
    block_ids: tuple[int, ...]
    epoch: int
    deadline: float
    token: int
    reported_checksum: int | None = None  # from verify(), awaiting the data
    outcome: BatonError | None = None  # the ending error, once decided
    verifying: bool = False  # the ending is a verification
    revoked_at: float | None = None
    quarantined: bool = False  # revoked, past the drain bound, a live writer's claim stands
    next_liveness_check: float = 0.0
    # Backends that receive actively (gloo) track the data here.
    receiving: bool = False
    arrived: bool = False
    busy: bool = False  # a receive thread is writing the blocks right now
    granted_ns: int = 0  # time.perf_counter_ns() of expect(), for the timeline
    completed: bool = False  # its RecvCompletion is queued (exactly one per lease)

    @property
    def ending(self) -> bool:
        return self.outcome is not None or self.verifying


class LeaseReceiver(KVReceiver):
    """Lease bookkeeping and the worker thread; backends allocate the pool and move data."""

    kind = ""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        config: TransferConfig | None = None,
        notify: Notify | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.incarnation = uuid.uuid4().hex
        self.layout = layout
        self.num_blocks = num_blocks
        self.config = config or TransferConfig()
        self._notify = notify
        self._cond = threading.Condition()
        self._leases: dict[str, Lease] = {}
        self._held: dict[int, str] = {}  # block id -> request id holding it
        self._done: deque[RecvCompletion] = deque()
        self._closing = False
        self._staging: Staging | None = None  # made on first verify, on the pool's device
        self._verify_pool: HostPool | None = None  # the CPU pool as bytes; first verify
        self._worker: threading.Thread | None = None
        self._failure: BaseException | None = None  # what killed the worker thread

    def _start_worker(self) -> None:
        """Subclasses call this once the pool exists."""
        self._worker = threading.Thread(
            target=self._run, name=f"baton-transfer-{self.kind}-receiver", daemon=True
        )
        self._worker.start()

    # -- KVReceiver -----------------------------------------------------------------------

    def expect(
        self, request_id: str, block_ids: tuple[int, ...], epoch: int, deadline: float
    ) -> KVDescriptor:
        block_ids = tuple(int(b) for b in block_ids)
        if not request_id:
            raise ValueError("request_id must be non-empty")
        if not block_ids:
            raise ValueError(f"request {request_id}: block_ids must be non-empty")
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad or len(set(block_ids)) != len(block_ids):
            raise ValueError(
                f"request {request_id}: block_ids {block_ids} repeat or leave "
                f"[0, {self.num_blocks})"
            )
        lease = Lease(
            request_id,
            block_ids,
            int(epoch),
            float(deadline),
            secrets.randbits(62) + 1,
            granted_ns=time.perf_counter_ns(),
        )
        with self._cond:
            if self._failure is not None:
                raise UnavailableError(
                    f"request {request_id}: {self.kind} receiver's worker thread died: "
                    f"{self._failure!r}"
                )
            if self._closing:
                raise UnavailableError(f"request {request_id}: {self.kind} receiver is closed")
            if request_id in self._leases:
                raise ValueError(f"request {request_id}: already holds a lease")
            taken = {b: self._held[b] for b in block_ids if b in self._held}
            if taken:
                raise ValueError(f"request {request_id}: blocks already leased: {taken}")
            self._arm(lease)
            self._leases[request_id] = lease
            self._held.update(dict.fromkeys(block_ids, request_id))
            self._cond.notify()
        logger.debug("request %s: leased %d blocks, epoch %d", request_id, len(block_ids), epoch)
        return KVDescriptor(self.endpoint, request_id, block_ids, lease.epoch, lease.token)

    def verify(self, request_id: str, checksum: int, epoch: int) -> None:
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is None or lease.ending or lease.reported_checksum is not None:
                logger.info("request %s: verify ignored, lease unknown or ending", request_id)
                return
            if epoch != lease.epoch:
                lease.outcome = AbortedError(
                    f"request {request_id}: epoch {epoch} reported, lease has {lease.epoch}"
                )
            else:
                lease.reported_checksum = int(checksum)
            self._cond.notify()

    def poll(self) -> list[RecvCompletion]:
        with self._cond:
            out = list(self._done)
            self._done.clear()
        return out

    def cancel(self, request_id: str) -> None:
        self._end(request_id, CancelledError(f"request {request_id}: cancelled"))

    def forget_sender(self, sender_incarnation: str) -> None:
        """Senders that write in place (shm, cuda_ipc) leave no state here."""

    @property
    def failure(self) -> BaseException | None:
        with self._cond:
            return self._failure

    def extend(self, request_id: str, deadline: float) -> None:
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is not None and not lease.ending and deadline > lease.deadline:
                lease.deadline = deadline

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            for lease in self._leases.values():
                if not lease.ending:
                    lease.outcome = UnavailableError(
                        f"request {lease.request_id}: {self.kind} receiver closed"
                    )
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join()
        self._shutdown()

    # -- backend hooks --------------------------------------------------------------------

    @property
    @abstractmethod
    def kv_cache(self) -> torch.Tensor: ...

    @property
    @abstractmethod
    def endpoint(self) -> KVEndpoint: ...

    def _arm(self, lease: Lease) -> None:
        """Make the new lease writable by its sender. Called under the lock."""

    def _revoke(self, lease: Lease) -> None:
        """Stop any new write to the lease's blocks. Called under the lock, once."""

    @abstractmethod
    def _writers_idle(self, lease: Lease) -> bool:
        """True when no peer is writing the revoked lease's blocks. Called under the lock."""

    @abstractmethod
    def _data_ready(self, lease: Lease) -> bool:
        """True when all the lease's data has landed. Called under the lock."""

    def _shutdown(self) -> None:
        """Release backend resources after every lease ended and the worker stopped."""

    # -- shared by backends -----------------------------------------------------------------

    def _end(self, request_id: str, error: BatonError) -> None:
        """Decide that ``request_id``'s lease ends with ``error`` (first decision wins)."""
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is None or lease.ending:
                return
            lease.outcome = error
            self._cond.notify()

    def _end_lease(self, lease: Lease, error: BatonError) -> None:
        """Like ``_end`` for this very lease (not a newer one of the same request)."""
        with self._cond:
            if self._leases.get(lease.request_id) is not lease or lease.ending:
                return
            lease.outcome = error
            self._cond.notify()

    # -- worker -----------------------------------------------------------------------------

    def _run(self) -> None:
        # Leases taken out of the table whose completion is not queued yet: should the
        # thread die among them, ``_die`` still owes each its one completion.
        finishing: list[Lease] = []
        try:
            serial_torch_here()  # leave OpenMP's team to the compute thread
            self._serve(finishing)
        except BaseException as exc:  # noqa: BLE001 - reported (failure, notify), never hidden
            self._die(exc, finishing)

    def _serve(self, finishing: list[Lease]) -> None:
        next_housekeeping = time.monotonic() + _HOUSEKEEPING_S
        while True:
            with self._cond:
                finished, timeout = self._sweep()
                if not finished:
                    if self._closing and not self._leases:
                        return
                    self._cond.wait(timeout)
            finishing.extend(finished)
            while finishing:
                self._finish(finishing[0])
                finishing.pop(0)
            if time.monotonic() >= next_housekeeping:
                self._housekeeping()
                next_housekeeping = time.monotonic() + _HOUSEKEEPING_S

    def _die(self, exc: BaseException, finishing: list[Lease]) -> None:
        """The dying worker thread's last act: end every pending lease, refuse new ones,
        tell the owner (``failure``, ``notify``).

        Each lease is revoked and its writers drained as on any ending, but the drain is
        bounded as on ``close``: nothing here will ever look at the lease again, and a
        request left without its completion would wait without ever learning why. Every
        backend hook may fail again (the fault that killed the thread), so a hook that
        raises counts as "writers not idle yet" until the bound."""
        logger.critical(
            "%s receiver %s: worker thread died; failing every pending lease",
            self.kind,
            self.incarnation,
            exc_info=exc,
        )
        with self._cond:
            self._failure = exc
            # The leases _sweep handed over have left the table: both lists, no overlap.
            leases = [lease for lease in finishing if not lease.completed]
            leases += self._leases.values()
            self._leases.clear()
            for lease in leases:
                if lease.outcome is None:  # pending, or verifying when the fault struck
                    lease.outcome = UnavailableError(
                        f"request {lease.request_id}: {self.kind} receiver's worker thread "
                        f"died: {exc!r}"
                    )
        deadline = time.monotonic() + min(self.config.drain_s, _CLOSE_DRAIN_S)
        busy = leases
        while True:
            with self._cond:
                busy = [lease for lease in busy if not self._quiet(lease)]
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(_QUARANTINE_POLL_S)
        for lease in busy:
            logger.error(
                "request %s: lease ended by the receiver's death although a writer may "
                "still hold %d of its block(s)",
                lease.request_id,
                len(lease.block_ids),
            )
        with self._cond:
            for lease in leases:
                for block in lease.block_ids:
                    self._held.pop(block, None)
                self._done.append(RecvCompletion(lease.request_id, lease.epoch, lease.outcome))
                lease.completed = True
            self._cond.notify_all()
        if self._notify is not None:
            try:
                self._notify()
            except Exception:
                logger.exception("%s receiver: notify after the worker's death failed", self.kind)

    def _quiet(self, lease: Lease) -> bool:
        """Revoke ``lease`` if not yet; True once no peer can write its blocks. Called
        under the lock by ``_die``; a hook that raises answers False."""
        try:
            if lease.revoked_at is None:
                self._revoke(lease)
                lease.revoked_at = time.monotonic()
            return self._writers_idle(lease) or self._clear_dead_writers(lease)
        except Exception:
            logger.exception("request %s: cannot drain the lease's writers", lease.request_id)
            return False

    def _housekeeping(self) -> None:
        """Backend hook, about once a second on the worker thread, outside the lock:
        drop state of peers that are gone."""

    def _sweep(self) -> tuple[list[Lease], float]:
        """Advance every lease; return the ones ready to complete and how long to sleep."""
        now = time.monotonic()
        timeout = _IDLE_WAKE_S
        finished: list[Lease] = []
        for lease in list(self._leases.values()):
            if not lease.ending:
                if lease.reported_checksum is not None and self._data_ready(lease):
                    lease.verifying = True
                elif now >= lease.deadline:
                    # The deadline moves with the peer's progress (``extend``): reaching it
                    # means the peer stalled, not that the client ran out of time.
                    lease.outcome = AbortedError(
                        f"request {lease.request_id}: KV did not arrive and verify by the "
                        "lease deadline (the prefill peer stopped making progress)"
                    )
                else:
                    timeout = min(timeout, lease.deadline - now)
                    continue
            if lease.revoked_at is None:
                self._revoke(lease)
                lease.revoked_at = now
            if self._writers_idle(lease) or self._writers_gone(lease, now):
                finished.append(lease)
                continue
            waited = now - lease.revoked_at
            if self._closing and waited > min(self.config.drain_s, _CLOSE_DRAIN_S):
                # The pool is being torn down: nothing will reuse these blocks.
                finished.append(lease)
                continue
            drained = waited > self.config.drain_s
            if drained and not lease.quarantined:
                lease.quarantined = True
                logger.error(
                    "request %s: a live peer still claims %d block(s) %.1f s after "
                    "the lease ended; quarantined until it lets go or dies",
                    lease.request_id,
                    len(lease.block_ids),
                    self.config.drain_s,
                )
            timeout = min(timeout, _QUARANTINE_POLL_S if drained else _DRAIN_POLL_S)
        for lease in finished:
            del self._leases[lease.request_id]
        return finished, max(timeout, 0.0)

    def _writers_gone(self, lease: Lease, now: float) -> bool:
        """True once every writer still claiming the lease's blocks is known dead (and
        its claims are cleared). Checked at most every ``_QUARANTINE_POLL_S``."""
        if now < lease.next_liveness_check:
            return False
        lease.next_liveness_check = now + _QUARANTINE_POLL_S
        return self._clear_dead_writers(lease)

    def _clear_dead_writers(self, lease: Lease) -> bool:
        """Backend hook: clear the claims of writers known dead; True if none is left.
        Writers that live in this process (a receive thread) never die apart from it."""
        return False

    @property
    def num_quarantined(self) -> int:
        """Leases ended past the drain bound whose blocks a live peer still claims."""
        with self._cond:
            return sum(1 for lease in self._leases.values() if lease.quarantined)

    def _finish(self, lease: Lease) -> None:
        error = lease.outcome
        if error is None:
            with self.timeline.span("verify", RECEIVE, {"request_id": lease.request_id}):
                error = self._check(lease)
        with self._cond:
            for block in lease.block_ids:
                self._held.pop(block, None)
            self._done.append(RecvCompletion(lease.request_id, lease.epoch, error))
            lease.completed = True
        if self.timeline.enabled:
            args: dict[str, object] = {
                "request_id": lease.request_id,
                "blocks": len(lease.block_ids),
            }
            if error is not None:
                args["error"] = type(error).__name__
            self.timeline.interval("lease", RECEIVE, lease.granted_ns, lease.request_id, args)
        if error is None:
            logger.debug("request %s: KV verified", lease.request_id)
        else:
            logger.info("request %s: lease ended: %s", lease.request_id, error)
        if self._notify is not None:
            self._notify()

    def _check(self, lease: Lease) -> BatonError | None:
        assert lease.reported_checksum is not None
        kv = self.kv_cache
        if self._staging is None:
            self._staging = Staging(kv.device)
            self._verify_pool = HostPool(kv) if kv.device.type == "cpu" else None
        actual = checksum_blocks(
            kv,
            self.layout,
            lease.block_ids,
            self.config.group_bytes,
            self._staging,
            self._verify_pool,
        )
        if actual != lease.reported_checksum:
            return AbortedError(
                f"request {lease.request_id}: checksum mismatch, prefill reported "
                f"{lease.reported_checksum:#x}, blocks hold {actual:#x}"
            )
        return None
