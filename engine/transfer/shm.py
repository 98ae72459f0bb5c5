"""The ``shm`` transport: decode's KV pool lives in POSIX shared memory; prefill writes into it.

The segment holds a header (magic, incarnation, layout, closed flag), two per-block
lease tables and the pool. ``owner[b]`` is the token of the lease that may receive
block b (0: none), written by the receiver alone; ``claim[b]`` is the id of the sender
copying into b (0: none). A sender takes a claim only with a compare-and-swap from 0
and, once the job ends, gives back only a claim that still holds its own id, so no
sender ever erases another's. It claims only while ``owner`` holds its token, claims
every block before copying, then re-reads ``owner`` before every layer group; a
receiver revokes ``owner``, then waits until no block of the lease is claimed. Every
access to those words is a seq_cst atomic (``shared_atomics``), so one side's store is
ordered before its load of the other's on any CPU (Dekker's handshake): no write lands
after the receiver has seen the blocks idle, and a revoked lease is never written.

A claim that stands is waited out for as long as its sender lives: a stalled sender may
still finish the group it is copying, so its blocks are quarantined, never reused. Only
a sender known dead (``writer_liveness``) has its claims cleared.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import time
import uuid
import weakref
from multiprocessing import resource_tracker

import numpy as np
import torch

from engine.errors import (
    AbortedError,
    LayoutMismatchError,
    ResourceExhaustedError,
    UnavailableError,
)
from engine.kv_layout import KVLayout
from engine.transfer.base import KVEndpoint, Notify, SendJob, TransferConfig
from engine.transfer.block_copy import (
    BlockIndex,
    HostPool,
    KVChecksum,
    Staging,
    layer_groups,
    layers_per_group,
    torch_dtype,
)
from engine.transfer.lease_receiver import Lease, LeaseReceiver
from engine.transfer.queued_sender import PeerLink, QueuedSender, StopCheck
from engine.transfer.shared_atomics import AtomicWords, WordIndex, atomic_ops
from engine.transfer.writer_liveness import WriterLock, writer_alive

logger = logging.getLogger(__name__)

_MAGIC = 0x6261746F6E4B5631  # "batonKV1"
_VERSION = 3  # 3: a claim is its writer's id, taken by compare-and-swap
_HEADER_BYTES = 4096
_PAGE = 4096
_SHM_DIR = "/dev/shm"
_DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
_DTYPES_BY_CODE = {code: name for name, code in _DTYPE_CODES.items()}
# Header words.
_W_MAGIC, _W_VERSION, _W_INC_HI, _W_INC_LO = 0, 1, 2, 3
_W_LAYERS, _W_BLOCK, _W_HEADS, _W_HEAD_DIM, _W_DTYPE, _W_BLOCKS = 4, 5, 6, 7, 8, 9
_W_CLOSED, _W_POOL_OFFSET, _W_DETERMINISTIC = 10, 11, 12
_HEADER_WORDS = 16
# How often a sender retries a block another sender claims (one on its way out: it saw
# the lease is not its own).
_CLAIM_RETRY_S = 0.001


def new_segment_name() -> str:
    return f"baton_kv_{uuid.uuid4().hex[:24]}"


def _split_uuid(hex_id: str) -> tuple[int, int]:
    value = uuid.UUID(hex=hex_id).int
    hi, lo = value >> 64, value & ((1 << 64) - 1)
    # Stored as int64: fold the top bit into the sign.
    return (hi - (1 << 64) if hi >= 1 << 63 else hi), (lo - (1 << 64) if lo >= 1 << 63 else lo)


def _join_uuid(hi: int, lo: int) -> str:
    return uuid.UUID(int=((hi & ((1 << 64) - 1)) << 64) | (lo & ((1 << 64) - 1))).hex


class ShmSegment:
    """Typed views over one receiver's segment, in whichever process mapped it.

    The views own the mapping: it is unmapped when the last of them (the engine's KV
    cache included) is gone. Nothing here calls ``mmap.close``, which would unmap memory
    under live views (``torch.frombuffer`` holds a reference, numpy a buffer export).
    The header is a numpy array; the lease tables are ``AtomicWords``, only ever
    accessed atomically (a lease check is well under a microsecond a block).
    """

    def __init__(self, buffer: mmap.mmap, with_pool: bool) -> None:
        self.header = np.frombuffer(buffer, dtype=np.int64, count=_HEADER_WORDS)
        if int(self.header[_W_MAGIC]) != _MAGIC or int(self.header[_W_VERSION]) != _VERSION:
            raise UnavailableError(
                f"shared-memory segment is not a baton KV pool of version {_VERSION}"
            )
        h = [int(x) for x in self.header.tolist()]
        self.incarnation = _join_uuid(h[_W_INC_HI], h[_W_INC_LO])
        self.layout = KVLayout(
            h[_W_LAYERS],
            h[_W_BLOCK],
            h[_W_HEADS],
            h[_W_HEAD_DIM],
            _DTYPES_BY_CODE.get(h[_W_DTYPE], "float32"),
            bool(h[_W_DETERMINISTIC]),
        )
        self.num_blocks = h[_W_BLOCKS]
        self.owner = AtomicWords(
            np.frombuffer(buffer, dtype=np.int64, count=self.num_blocks, offset=_HEADER_BYTES)
        )
        self.claim = AtomicWords(
            np.frombuffer(
                buffer,
                dtype=np.int64,
                count=self.num_blocks,
                offset=_HEADER_BYTES + 8 * self.num_blocks,
            )
        )
        self.pool: torch.Tensor | None = None
        if with_pool:
            shape = self.layout.pool_shape(self.num_blocks)
            self.pool = torch.frombuffer(
                buffer,
                dtype=torch_dtype(self.layout),
                count=math.prod(shape),
                offset=h[_W_POOL_OFFSET],
            ).view(shape)

    @staticmethod
    def size(layout: KVLayout, num_blocks: int, with_pool: bool) -> tuple[int, int]:
        """(total bytes, pool offset) of a segment."""
        tables = 2 * 8 * num_blocks
        pool_offset = _HEADER_BYTES + (tables + _PAGE - 1) // _PAGE * _PAGE
        pool_bytes = layout.block_bytes * num_blocks if with_pool else 0
        return pool_offset + pool_bytes, pool_offset

    @staticmethod
    def write_header(
        buffer: mmap.mmap, layout: KVLayout, num_blocks: int, incarnation: str, pool_offset: int
    ) -> None:
        header = np.frombuffer(buffer, dtype=np.int64, count=_HEADER_WORDS)
        inc_hi, inc_lo = _split_uuid(incarnation)
        values = {
            _W_VERSION: _VERSION,
            _W_INC_HI: inc_hi,
            _W_INC_LO: inc_lo,
            _W_LAYERS: layout.num_layers,
            _W_BLOCK: layout.block_size,
            _W_HEADS: layout.num_kv_heads,
            _W_HEAD_DIM: layout.head_dim,
            _W_DTYPE: _DTYPE_CODES[layout.dtype],
            _W_BLOCKS: num_blocks,
            _W_POOL_OFFSET: pool_offset,
            _W_DETERMINISTIC: int(layout.deterministic),
        }
        for word, value in values.items():
            header[word] = value
        header[_W_MAGIC] = _MAGIC  # last: a half-written header is never valid
        del header

    @property
    def closed(self) -> bool:
        return bool(self.header[_W_CLOSED])

    def mark_closed(self) -> None:
        self.header[_W_CLOSED] = 1

    def release(self) -> None:
        """Drop our views; the mapping lives on while others (the engine) hold the pool."""
        self.header = np.empty(0, dtype=np.int64)
        # Empty tables: a late access fails on its index, never touches unmapped memory.
        self.owner = self.claim = AtomicWords(self.header)
        self.pool = None


def _segment_path(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"shm segment name must be non-empty without '/', got {name!r}")
    return f"{_SHM_DIR}/{name}"


def create_segment(
    name: str, layout: KVLayout, num_blocks: int, incarnation: str, with_pool: bool
) -> ShmSegment:
    """Create and initialise a new segment; the caller owns it and calls ``unlink_segment``.

    The whole segment is backed with memory at once, so a full /dev/shm fails here,
    cleanly, instead of as SIGBUS on a later write, and mapped populated, so no transfer
    or verify pays first-touch faults (a 16-block write into a fresh mapping measured
    3.2 ms, against 0.9 ms populated; populating 1 GiB costs about 0.3 s here, once).
    The resource tracker unlinks it should this process die without doing so.
    """
    path = _segment_path(name)
    total, pool_offset = ShmSegment.size(layout, num_blocks, with_pool)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(f"shm segment {name!r} already exists; pick another address") from None
    try:
        os.posix_fallocate(fd, 0, total)
        mapping = _map(fd, total)
    except OSError as exc:
        os.unlink(path)
        raise ResourceExhaustedError(
            f"{_SHM_DIR} cannot hold the {total}-byte KV segment {name!r}: {exc}"
        ) from exc
    finally:
        os.close(fd)
    resource_tracker.register(f"/{name}", "shared_memory")
    ShmSegment.write_header(mapping, layout, num_blocks, incarnation, pool_offset)
    return ShmSegment(mapping, with_pool)


def _map(fd: int, size: int) -> mmap.mmap:
    """A shared mapping with its page tables filled now rather than on first touch."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def unlink_segment(name: str) -> None:
    """Remove the segment's name; its memory goes once the last mapping is dropped."""
    try:
        os.unlink(_segment_path(name))
    except FileNotFoundError:
        logger.warning("shm segment %s was already unlinked", name)
    resource_tracker.unregister(f"/{name}", "shared_memory")


def attach_segment(name: str, with_pool: bool) -> ShmSegment:
    """Map an existing segment, populated (see ``create_segment``). Not registered with the
    resource tracker, which would unlink the receiver's segment when this process exits."""
    try:
        fd = os.open(_segment_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise UnavailableError(f"shm segment {name!r} is gone (receiver closed)") from None
    try:
        mapping = _map(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return ShmSegment(mapping, with_pool)


class ShmReceiver(LeaseReceiver):
    """Decode's pool in a fresh shared-memory segment named ``address`` (random if empty)."""

    kind = "shm"
    pool_in_segment = True  # cuda_ipc keeps only the lease tables here

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        address: str = "",
        config: TransferConfig | None = None,
        notify: Notify | None = None,
        device: str = "cpu",
    ) -> None:
        require_atomics(self.kind)
        super().__init__(layout, num_blocks, config, notify)
        name = address or new_segment_name()
        self._segment = create_segment(
            name, layout, num_blocks, self.incarnation, with_pool=self.pool_in_segment
        )
        try:
            self._kv, handle = self._allocate_pool(torch.device(device))
        except BaseException:
            self._segment.release()
            unlink_segment(name)
            raise
        self._endpoint = KVEndpoint(self.kind, name, self.incarnation, layout, num_blocks, handle)
        self._start_worker()
        logger.info(
            "%s receiver %s: pool of %d blocks, lease tables in segment %s",
            self.kind,
            self.incarnation,
            num_blocks,
            name,
        )

    def _allocate_pool(self, device: torch.device) -> tuple[torch.Tensor, bytes]:
        """The pool tensor and the endpoint's backend handle."""
        if device.type != "cpu":
            raise ValueError(f"the shm transport keeps its pool on the CPU, got device {device}")
        assert self._segment.pool is not None
        return self._segment.pool, b""

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv

    @property
    def endpoint(self) -> KVEndpoint:
        return self._endpoint

    def _arm(self, lease: Lease) -> None:
        owner = self._segment.owner
        owner.store_all(owner.index(lease.block_ids), lease.token)

    def _revoke(self, lease: Lease) -> None:
        owner = self._segment.owner
        owner.store_all(owner.index(lease.block_ids), 0)

    def _writers_idle(self, lease: Lease) -> bool:
        # Any claim counts, whatever lease its sender holds: a stale sender that claimed
        # before reading ``owner`` again has not yet seen that the blocks are not its own.
        claim = self._segment.claim
        return claim.all_equal(claim.index(lease.block_ids), 0)

    def _clear_dead_writers(self, lease: Lease) -> bool:
        claim = self._segment.claim
        held = {block: claim.load(block) for block in lease.block_ids}
        held = {block: writer for block, writer in held.items() if writer}
        writers = set(held.values())
        if any(writer_alive(w) for w in writers):
            return False
        # Every claimant is gone: nothing can write these blocks any more. The swap
        # clears only the dead writer's claim, never one taken since.
        cleared = sum(claim.cas(block, writer, 0) == writer for block, writer in held.items())
        if cleared:
            logger.warning(
                "request %s: sender(s) %s died holding %d block claim(s); cleared",
                lease.request_id,
                sorted(writers),
                cleared,
            )
        return self._writers_idle(lease)

    def _data_ready(self, lease: Lease) -> bool:
        return True  # senders write in place; verify is the arrival signal

    def _shutdown(self) -> None:
        self._segment.mark_closed()
        self._segment.release()
        unlink_segment(self._endpoint.address)


class ShmLink(PeerLink):
    """A mapped receiver segment; copies source blocks straight into its pool."""

    def __init__(
        self,
        segment: ShmSegment,
        pool: torch.Tensor,
        kv: torch.Tensor,
        layout: KVLayout,
        config: TransferConfig,
        writer: int,
        name: str,
    ) -> None:
        self.incarnation = segment.incarnation
        self._writer = writer
        self._name = name
        self._segment = segment
        self._pool = pool
        self._kv = kv
        self._layout = layout
        self._config = config
        self._staging = Staging(kv.device)
        on_cpu = kv.device.type == "cpu" and pool.device.type == "cpu"
        self._src_host = HostPool(kv) if on_cpu else None
        self._dst_host = HostPool(pool) if on_cpu else None

    def send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        desc = job.descriptor
        dst = BlockIndex(desc.block_ids, self._pool.device)
        src = BlockIndex(job.src_block_ids, self._kv.device)
        n = len(desc.block_ids)
        per_group = layers_per_group(self._layout, n, self._config.group_bytes)
        checksum = KVChecksum()
        nbytes = 0
        blocks = self._segment.claim.index(desc.block_ids)
        self._claim(job, blocks)
        try:
            for group, (lo, hi) in enumerate(layer_groups(self._layout.num_layers, per_group)):
                stop(group)
                self._check_lease(job, blocks)
                nbytes += self._copy_group(group, lo, hi, src, dst, checksum)
            self._quiesce()
            return checksum.value, nbytes
        finally:
            self._quiesce()  # nothing may still be in flight once the claims are gone
            self._release(blocks, len(blocks))

    def _claim(self, job: SendJob, blocks: WordIndex) -> None:
        """Claim every destination block for this sender, or (raising) none.

        A block is claimed only while its lease is ours: a stale sender, whose lease
        ended while its job sat queued, touches no claim. Another sender's claim is one
        on its way out (it claimed just as the blocks changed hands, and lets go once it
        reads ``owner``), so it is waited for, within the stall bound.
        """
        claim = self._segment.claim
        held = 0  # blocks[:held] are ours
        give_up = min(job.deadline, time.monotonic() + self._config.stall_timeout_s)
        try:
            while True:
                self._check_lease(job, blocks)
                held += claim.cas_prefix(blocks, 0, self._writer, start=held)
                if held == len(blocks):
                    break
                if time.monotonic() > give_up:
                    block = int(blocks.array[held])
                    raise AbortedError(
                        f"request {job.request_id}: destination block {block} stayed "
                        f"claimed by sender {claim.load(block):#x}; nothing written"
                    )
                time.sleep(_CLAIM_RETRY_S)
            # The claims are stored before ``owner`` is read again (all seq_cst): a
            # receiver that revoked the lease before this read sees them and waits.
            self._check_lease(job, blocks)
        except BaseException:
            self._release(blocks, held)
            raise

    def _release(self, blocks: WordIndex, held: int) -> None:
        """Give back our claims on ``blocks[:held]``; one that is not ours (any more) is
        left alone."""
        claim = self._segment.claim
        start = 0
        while start < held:
            start += claim.cas_prefix(blocks, self._writer, 0, start=start, end=held) + 1

    def _copy_group(
        self, group: int, lo: int, hi: int, src: BlockIndex, dst: BlockIndex, checksum: KVChecksum
    ) -> int:
        """Copy one layer group of the job into the pool; return its bytes."""
        assert self._src_host is not None
        return self._src_host.stream(lo, hi, src, checksum, self._staging, self._dst_host, dst)

    def _quiesce(self) -> None:
        """Block until every copy issued so far has landed (CPU copies already have)."""

    def _check_lease(self, job: SendJob, dst: WordIndex) -> None:
        if self._segment.closed:
            self.broken = True
            raise UnavailableError(
                f"request {job.request_id}: receiver {self.incarnation} closed its pool"
            )
        if not self._segment.owner.all_equal(dst, job.descriptor.lease_token):
            raise AbortedError(
                f"request {job.request_id}: destination lease was revoked (cancelled, "
                "expired or superseded); nothing more written"
            )

    def gone(self) -> bool:
        # Closed cleanly, or unlinked (by its owner or, after a crash, its resource
        # tracker): either way no lease on it can ever be granted again.
        return self._segment.closed or not os.path.exists(_segment_path(self._name))

    def close(self) -> None:
        self._pool = torch.empty(0)
        self._src_host = self._dst_host = None
        self._segment.release()  # unmapped as our views go


class ShmSender(QueuedSender):
    """Writes into receivers' shared-memory pools on this host."""

    kind = "shm"
    pool_in_segment = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        require_atomics(self.kind)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # Held for this sender's life: receivers tell a stalled writer from a dead one.
        self._writer_lock = WriterLock(self.incarnation)
        # A sender never closed is closed at interpreter exit, so its lock file goes too.
        weakref.finalize(self, _close_at_exit, weakref.ref(self))

    def close(self) -> None:
        super().close()
        # Only once nothing can write: a missing lock file reads as a dead sender, whose
        # claims receivers clear. Otherwise the lock goes with the process.
        if not any(thread.is_alive() for thread in self._threads):
            self._writer_lock.close()

    def _connect(self, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        segment = attach_segment(endpoint.address, with_pool=self.pool_in_segment)
        try:
            _check_peer(segment, endpoint, self.layout)
            link = self._make_link(segment, endpoint)
        except BaseException:
            segment.release()
            raise
        logger.info(
            "%s sender %s: mapped pool of receiver %s at %s",
            self.kind,
            self.incarnation,
            segment.incarnation,
            endpoint.address,
        )
        return link

    def _make_link(self, segment: ShmSegment, endpoint: KVEndpoint) -> ShmLink:
        assert segment.pool is not None
        return ShmLink(
            segment,
            segment.pool,
            self.kv_cache,
            self.layout,
            self.config,
            self._writer_lock.id,
            endpoint.address,
        )


def _check_peer(segment: ShmSegment, endpoint: KVEndpoint, layout: KVLayout) -> None:
    """The handshake: the live segment must be the named incarnation, open, same layout."""
    if segment.incarnation != endpoint.incarnation:
        raise UnavailableError(
            f"segment {endpoint.address} belongs to receiver {segment.incarnation}, "
            f"descriptor names {endpoint.incarnation} (restarted)"
        )
    if segment.closed:
        raise UnavailableError(f"receiver {segment.incarnation} closed segment {endpoint.address}")
    diff = layout.mismatch(segment.layout)
    if diff is not None:
        raise LayoutMismatchError(
            f"receiver {segment.incarnation} at {endpoint.address} has a different KV layout "
            f"({diff})"
        )
    if segment.num_blocks != endpoint.num_blocks:
        raise UnavailableError(
            f"segment {endpoint.address} has {segment.num_blocks} blocks, "
            f"descriptor says {endpoint.num_blocks}"
        )


def _close_at_exit(sender: weakref.ref[ShmSender]) -> None:
    live = sender()
    if live is not None:
        live.close()


def require_atomics(kind: str) -> None:
    """Refuse to run a transport whose lease tables cannot be made safe on this CPU."""
    try:
        atomic_ops()
    except RuntimeError as exc:
        raise RuntimeError(f"the {kind} transport cannot run here: {exc}") from exc
