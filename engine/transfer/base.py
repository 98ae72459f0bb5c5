"""The KV transport seam: the records that cross it and the two abstract sides.

A decode worker owns a ``KVReceiver`` (it allocates the decode KV pool, grants leases on
destination blocks and verifies what arrived); a prefill worker owns a ``KVSender`` (it
copies source blocks into a receiver's leased blocks on its own worker thread). Neither
side ever blocks the engine thread: every call here except ``close`` only enqueues work,
and results come back as completion records drained by ``poll``.

Torch-free, so that rpc/ can map these records to and from protos.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import BatonError
from engine.kv_layout import KVLayout
from engine.timeline import OFF, TimelineRecorder
from engine.transfer.fleet_auth import FleetKey

if TYPE_CHECKING:
    import torch

TRANSPORT_KINDS = ("shm", "gloo", "cuda_ipc", "nccl", "nixl")
# Where each transport keeps and moves KV: the device types its pools may live on (the
# first is its default).
TRANSPORT_DEVICE_TYPES: dict[str, tuple[str, ...]] = {
    "shm": ("cpu",),
    "gloo": ("cpu",),
    "cuda_ipc": ("cuda",),
    "nccl": ("cuda",),
    "nixl": ("cpu", "cuda"),
}

# Called on a transport worker thread right after a completion is queued, so an asyncio
# loop can be woken (``loop.call_soon_threadsafe``). It must not block.
Notify = Callable[[], None]


def check_transport_device(kind: str, device: str) -> None:
    """Refuse a transport that cannot move KV living on ``device`` (``cpu`` / ``cuda[:N]``):
    raises ValueError naming both and the transports that would fit."""
    if kind not in TRANSPORT_DEVICE_TYPES:
        raise ValueError(f"transport must be one of {list(TRANSPORT_KINDS)}, got {kind!r}")
    have = device.partition(":")[0]
    want = TRANSPORT_DEVICE_TYPES[kind]
    if have not in want:
        fits = [k for k, types in TRANSPORT_DEVICE_TYPES.items() if have in types]
        raise ValueError(
            f"transport {kind!r} moves KV between {' or '.join(w.upper() for w in want)} "
            f"pools, but device is "
            f"{device!r}; with that device use transport {' or '.join(fits) or '(none)'}"
        )


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Tuning shared by every backend; built once by the service and passed down."""

    # Target size of one layer-group message: blocks move a group of layers at a time.
    group_bytes: int = 16 << 20
    # How long connecting to a peer (store, process group, mapping) may take.
    connect_timeout_s: float = 10.0
    # How long a started transfer may go silent before its link is declared dead.
    stall_timeout_s: float = 30.0
    # How long a revoked lease may wait for a live peer that is mid-write before its blocks
    # are reported quarantined (logged, counted). They stay out of use until the write
    # claim clears or the peer is known dead, however long that takes. None: the stall
    # bound; never less, since a live sender may legitimately take that long per group.
    drain_timeout_s: float | None = None
    # A sender drops its cached state for a receiver (mapping, process group) after this
    # long without a job to it; a receiver drops a sender's pair after twice as long, so
    # a live sender always reconnects before its old pair is reaped.
    peer_idle_s: float = 300.0
    # The fleet's shared secret (``fleet_auth``): with it, the gloo/nccl rendezvous admits
    # only senders that prove they hold it, and senders prove it. None: no check.
    fleet_key: FleetKey | None = None

    def __post_init__(self) -> None:
        if self.group_bytes < 1:
            raise ValueError(f"TransferConfig.group_bytes must be >= 1, got {self.group_bytes}")
        if self.drain_timeout_s is None:
            object.__setattr__(self, "drain_timeout_s", self.stall_timeout_s)
        for name in ("connect_timeout_s", "stall_timeout_s", "drain_timeout_s", "peer_idle_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0, got {getattr(self, name)}")
        assert self.drain_timeout_s is not None
        if self.drain_timeout_s < self.stall_timeout_s:
            raise ValueError(
                f"TransferConfig.drain_timeout_s ({self.drain_timeout_s}) must be >= "
                f"stall_timeout_s ({self.stall_timeout_s})"
            )

    @property
    def drain_s(self) -> float:
        """``drain_timeout_s``, resolved."""
        assert self.drain_timeout_s is not None
        return self.drain_timeout_s


@dataclass(frozen=True, slots=True)
class KVEndpoint:
    """Where one receiver incarnation's KV pool can be reached. Fixed for its lifetime."""

    kind: str  # one of TRANSPORT_KINDS
    # shm / cuda_ipc: the shared-memory segment name; gloo / nccl: "host:port" of the store.
    address: str
    incarnation: str  # the receiver's incarnation id (uuid4 hex)
    layout: KVLayout
    num_blocks: int
    # Backend-specific bytes the sender needs to open the pool (cuda_ipc: the exported
    # memory handle); empty for the others.
    handle: bytes = b""


@dataclass(frozen=True, slots=True)
class KVDescriptor:
    """A lease on destination blocks for one request, made by ``KVReceiver.expect``.

    Decode sends it to prefill as is; prefill hands it to its sender untouched.
    """

    endpoint: KVEndpoint
    request_id: str
    block_ids: tuple[int, ...]  # destination blocks, in token order
    # The leased blocks' generation in decode's block pool (``BlockPool.generation``):
    # prefill echoes it, the receiver compares it at verify, and decode's engine checks it
    # against the pool again before the request may run.
    epoch: int
    lease_token: int  # random, non-zero; identifies this lease on the wire
    # The receiver already holds the prompt's first ``first_block`` logical blocks (its
    # prefix cache): ``block_ids`` are the prompt's blocks from this one on, and the
    # sender sends its own from here.
    first_block: int = 0


@dataclass(frozen=True, slots=True)
class SendJob:
    """Prefill's order to copy ``src_block_ids`` into the blocks leased by ``descriptor``."""

    request_id: str
    src_block_ids: tuple[int, ...]  # same length and token order as descriptor.block_ids
    descriptor: KVDescriptor
    deadline: float  # absolute, time.monotonic() of the prefill process


@dataclass(slots=True)
class SendCompletion:
    """The outcome of one ``SendJob``; exactly one per submitted job."""

    request_id: str
    epoch: int
    checksum: int | None  # over exactly the bytes sent, in token order; None on failure
    num_bytes: int
    error: BatonError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class RecvCompletion:
    """The end of one lease; exactly one per ``expect``. Only after it may the blocks be reused."""

    request_id: str
    epoch: int
    error: BatonError | None = None  # None: verified, the request may run

    @property
    def ok(self) -> bool:
        return self.error is None


class KVSender(ABC):
    """The prefill side: copies local blocks into a receiver's leased blocks.

    Jobs to one receiver address move in submission order on that address's own worker
    thread, so a silent receiver never delays jobs to another. The sender reads the
    source blocks until the job's completion is queued; the caller must not free or
    overwrite them before that (in practice: not before decode acknowledges).
    Peer state (mappings, process groups) is cached per receiver address and dropped when
    a descriptor names a different incarnation at that address.
    """

    incarnation: str  # uuid4 hex, fixed at construction
    # Where each job's ``send`` span goes (engine.timeline); set before the first job.
    timeline: TimelineRecorder = OFF

    @abstractmethod
    def submit(self, job: SendJob) -> None:
        """Queue ``job``; never blocks on the transfer. Exactly one ``SendCompletion``
        follows. Raises ``ValueError`` at once for a malformed job (ids out of range,
        lengths differ, wrong kind) and ``LayoutMismatchError`` when the descriptor's
        layout differs from ours. Raises ``UnavailableError`` after ``close``."""

    @abstractmethod
    def poll(self) -> list[SendCompletion]:
        """Drain the completions queued so far. Non-blocking; safe from any thread."""

    @property
    @abstractmethod
    def progress(self) -> int:
        """A counter that grows every time the sender moves a piece of data (a layer
        group): a caller that sees it change knows the sender is not stuck. Safe from any
        thread."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Stop the job for ``request_id``: a queued one is dropped, one in flight stops at
        its next layer group; either completes with ``CancelledError``. Non-blocking; a
        no-op for unknown or finished requests, so it may be called twice."""

    @abstractmethod
    def close(self) -> None:
        """Fail every pending job with ``UnavailableError``, join the worker, release peer
        state. Blocks for the in-flight step at most: one layer group (bounded by
        ``stall_timeout_s``) or one connect (``connect_timeout_s``). Idempotent."""


class KVReceiver(ABC):
    """The decode side: owns the KV pool, grants leases, verifies what arrived.

    Every ``expect`` yields exactly one ``RecvCompletion``. The receiver never frees
    blocks: the caller's block pool may reuse a lease's blocks only after polling its
    completion, because until then a peer may still be writing them. After the
    completion no transport write reaches those blocks.
    """

    incarnation: str  # uuid4 hex, fixed at construction
    # Where each lease and verify span goes (engine.timeline); set before the first lease.
    timeline: TimelineRecorder = OFF

    @property
    @abstractmethod
    def kv_cache(self) -> torch.Tensor:
        """The whole KV pool, ``layout.pool_shape(num_blocks)``; the engine computes in it."""

    @property
    @abstractmethod
    def endpoint(self) -> KVEndpoint:
        """How senders reach this receiver incarnation."""

    @abstractmethod
    def expect(
        self, request_id: str, block_ids: tuple[int, ...], epoch: int, deadline: float
    ) -> KVDescriptor:
        """Lease ``block_ids`` to ``request_id`` until ``deadline`` (time.monotonic()).
        Non-blocking. Raises ``ValueError`` if the request already holds a lease, or a
        block is out of range, repeated, or leased to another request. If the lease has
        not verified by ``deadline`` (see ``extend``) it ends with ``AbortedError``: the
        peer stopped making progress."""

    @abstractmethod
    def verify(self, request_id: str, checksum: int, epoch: int) -> None:
        """Prefill reports the transfer done. Non-blocking: the receiver's worker waits
        for the data, stops further writes, recomputes the checksum over the leased
        blocks and ends the lease (``AbortedError`` on a checksum or epoch mismatch).
        Ignored for an unknown or already ended lease, so it may be called twice."""

    @abstractmethod
    def poll(self) -> list[RecvCompletion]:
        """Drain the completions queued so far. Non-blocking; safe from any thread."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """End the lease with ``CancelledError``; late data is discarded. Non-blocking (the
        completion follows once no peer is mid-write, which for a stalled but live peer
        may be much later: its blocks stay quarantined meanwhile); a no-op if unknown or
        ended."""

    @property
    @abstractmethod
    def num_quarantined(self) -> int:
        """Ended leases whose blocks a stalled but live sender still claims. Safe from any
        thread."""

    @abstractmethod
    def forget_sender(self, sender_incarnation: str) -> None:
        """Drop every connection of that sender incarnation (it restarted or left): its
        pair threads and process groups. Non-blocking; a no-op if unknown."""

    @property
    def failure(self) -> BaseException | None:
        """What killed the receiver's worker thread; None while it runs. After a death
        every lease has ended with ``UnavailableError`` (``poll`` hands the completions
        out, ``notify`` was called) and ``expect`` raises ``UnavailableError``: the owner
        must stop serving. Safe from any thread."""
        return None

    @abstractmethod
    def extend(self, request_id: str, deadline: float) -> None:
        """Move the lease's deadline to ``deadline`` if that is later: the peer showed
        progress. Non-blocking; a no-op for an unknown or ending lease."""

    @abstractmethod
    def close(self) -> None:
        """End every lease with ``UnavailableError``, stop accepting peers, join threads,
        unlink the pool's shared resources. Blocks until no peer can still write (at most
        ``drain_timeout_s`` per lease, or one layer group in flight). The ``kv_cache``
        tensor stays valid while referenced. Idempotent; completions stay pollable."""
