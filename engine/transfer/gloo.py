"""The ``gloo`` transport (and, by subclassing, ``nccl``): point-to-point on a pair group.

The receiver hosts a TCPStore on ``host:port`` (port 0 picks one; the endpoint carries
the real one). Each sender incarnation gets its own 2-rank group (receiver rank 0,
sender rank 1) built straight from the store under a prefix naming both incarnations,
so no global ``init_process_group`` is needed and peers start in any order. The sender
gathers a layer group into staging and sends it while gathering the next; the receiver
receives into staging and scatters into the leased blocks, or drops the data when the
lease has ended, so late data never reaches reallocated blocks. Control (hello, verdict,
readiness, job headers) goes through the store; see ``store_protocol``. A link is used
only after the receiver reports its side of the group built and proven by a handshake;
every failure on the way is typed, and a failed pair never takes the receiver down.
Hellos are taken in any order (``HelloInbox``): a number taken and never used, by a
sender that died or by anyone who reaches the store, is given up after the connect
timeout and holds up no one. A sender waits for its verdict at most the connect
timeout; a silent receiver is ``AbortedError``, retryable. With a fleet secret in the
config, the receiver admits only senders whose hello (and job headers) carry its tag,
and each side checks every value it reads from the store (``store_protocol.seal``).

On a GPU (nccl) every copy, send and receive runs on the transport's own stream, after
the fence of its hand-over (``cuda_stream``): never behind the engine's later kernels.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import (
    AbortedError,
    BatonError,
    DeadlineExceededError,
    LayoutMismatchError,
    PermissionDeniedError,
    UnavailableError,
)
from engine.kv_layout import KVLayout
from engine.transfer.base import KVEndpoint, Notify, SendJob, TransferConfig
from engine.transfer.block_copy import (
    BlockIndex,
    HostPool,
    KVChecksum,
    Staging,
    gather,
    group_nbytes,
    group_shape,
    layer_groups,
    layers_per_group,
    scatter,
    torch_dtype,
)
from engine.transfer.cuda_stream import FenceBook, TransferStream
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.lease_receiver import Lease, LeaseReceiver
from engine.transfer.pair_group import (
    RECEIVER_RANK,
    SENDER_RANK,
    HelloInbox,
    KeySeries,
    PairGroup,
    client_store,
    link_error,
    local_address_towards,
    parse_address,
    past_deadline,
    read_sealed,
    release_failed_group,
)
from engine.transfer.queued_sender import PeerLink, QueuedSender, StopCheck
from engine.transfer.store_protocol import (
    AUTH_HMAC,
    FLAG_ABORT,
    GROUP_HEADER_BYTES,
    KEY_AUTH,
    KEY_HELLO_BELL,
    KEY_HELLO_COUNT,
    KEY_INCARNATION,
    KEY_LAYOUT,
    READY_OK,
    VERDICT_NO_SECRET,
    VERDICT_OK,
    Hello,
    JobHeader,
    decode_layout,
    encode_layout,
    hello_key,
    job_key,
    message_tag,
    open_hello,
    open_job,
    pair_prefix,
    ready_key,
    seal,
    sign_hello,
    sign_job,
    unseal,
    verdict_key,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pair:
    """One sender connection as the receiver sees it."""

    number: int
    sender: str
    thread: threading.Thread
    jobs: KeySeries | None = None  # set by the pair thread once its group exists
    stopped: bool = False
    last_active: float = 0.0  # time.monotonic() of its hello or its last job


class GlooReceiver(LeaseReceiver):
    """Decode's pool as a plain tensor, fed by pair groups of the senders that say hello."""

    kind = "gloo"
    pair_group: PairGroup = PairGroup()

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        address: str = "127.0.0.1:0",
        config: TransferConfig | None = None,
        notify: Notify | None = None,
        device: str = "cpu",
    ) -> None:
        if torch.device(device).type != self.pair_group.device.type:
            raise ValueError(
                f"a {self.kind} receiver keeps its pool on "
                f"{self.pair_group.device.type}, got device {device!r}"
            )
        super().__init__(layout, num_blocks, config, notify)
        host, port = parse_address(address or "127.0.0.1:0")
        self._kv = torch.zeros(
            layout.pool_shape(num_blocks), dtype=torch_dtype(layout), device=device
        )
        self._host_kv = HostPool(self._kv) if self._kv.device.type == "cpu" else None
        self._transfer = TransferStream(self._kv.device)
        self._fences = FenceBook(self._transfer)  # per lease token: compute before the lease
        timeout = timedelta(seconds=self.config.connect_timeout_s)
        try:
            self._store = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False)
        except RuntimeError as exc:
            raise UnavailableError(f"cannot serve the KV store on {host}:{port}: {exc}") from exc
        self._host = host
        self._port = self._store.port
        key = self.config.fleet_key
        self._store.set(KEY_LAYOUT, seal(key, self.incarnation, KEY_LAYOUT, encode_layout(layout)))
        self._store.set(KEY_INCARNATION, seal(key, "", KEY_INCARNATION, self.incarnation.encode()))
        if self.config.fleet_key is not None:
            self._store.set(KEY_AUTH, AUTH_HMAC)
        self._endpoint = KVEndpoint(
            self.kind, f"{host}:{self._port}", self.incarnation, layout, num_blocks
        )
        self._pairs_lock = threading.Lock()
        self._pairs: dict[int, _Pair] = {}
        self._hellos = HelloInbox(self._client(), self.config.connect_timeout_s)
        self._accept = threading.Thread(
            target=self._accept_main, daemon=True, name=f"baton-transfer-{self.kind}-accept"
        )
        self._accept.start()
        self._start_worker()
        logger.info(
            "%s receiver %s: pool of %d blocks, store at %s",
            self.kind,
            self.incarnation,
            num_blocks,
            self._endpoint.address,
        )

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv

    @property
    def endpoint(self) -> KVEndpoint:
        return self._endpoint

    # -- lease hooks ------------------------------------------------------------------------

    def _arm(self, lease: Lease) -> None:
        self._fences.record(lease.token)

    def _revoke(self, lease: Lease) -> None:
        self._fences.take(lease.token)

    def _writers_idle(self, lease: Lease) -> bool:
        return not lease.busy

    def _data_ready(self, lease: Lease) -> bool:
        return lease.arrived

    def _shutdown(self) -> None:
        self._hellos.interrupt(self._store)
        self._accept.join()
        with self._pairs_lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            self._stop_pair(pair)
        for pair in pairs:
            pair.thread.join(self.config.stall_timeout_s)
            if pair.thread.is_alive():
                logger.warning(
                    "%s receiver %s: pair %d thread did not stop",
                    self.kind,
                    self.incarnation,
                    pair.number,
                )
        del self._store  # shuts the store server down

    def _check(self, lease: Lease) -> BatonError | None:
        with self._transfer.active():  # the verify gather must not wait for decode kernels
            return super()._check(lease)

    def _client(self) -> dist.TCPStore:
        return client_store(self._host, self._port, self.config.connect_timeout_s)

    @property
    def num_pairs(self) -> int:
        """Sender connections with a live pair thread."""
        with self._pairs_lock:
            return sum(1 for p in self._pairs.values() if p.thread.is_alive() and not p.stopped)

    def forget_sender(self, sender_incarnation: str) -> None:
        with self._pairs_lock:
            gone = [p for p in self._pairs.values() if p.sender == sender_incarnation]
        for pair in gone:
            logger.info(
                "%s receiver %s: dropping pair %d of departed sender %s",
                self.kind,
                self.incarnation,
                pair.number,
                sender_incarnation,
            )
            self._stop_pair(pair)

    def _housekeeping(self) -> None:
        # A live sender reconnects after peer_idle_s without a job; a pair idle for twice
        # that belongs to a sender that is gone.
        now = time.monotonic()
        with self._pairs_lock:
            idle = [
                p
                for p in self._pairs.values()
                if not p.stopped and now - p.last_active > 2 * self.config.peer_idle_s
            ]
            # Forget pairs whose thread has ended (ident None: not started yet).
            self._pairs = {
                k: p
                for k, p in self._pairs.items()
                if p.thread.is_alive() or p.thread.ident is None
            }
        for pair in idle:
            logger.info(
                "%s receiver %s: dropping pair %d of sender %s, idle %.0f s",
                self.kind,
                self.incarnation,
                pair.number,
                pair.sender,
                now - pair.last_active,
            )
            self._stop_pair(pair)

    def _stop_pair(self, pair: _Pair) -> None:
        with self._pairs_lock:
            pair.stopped = True
            jobs = pair.jobs
        if jobs is not None:
            jobs.interrupt(self._store)

    # -- accepting senders ------------------------------------------------------------------

    def _accept_main(self) -> None:
        while (hello := self._hellos.take()) is not None:
            self._admit(*hello)

    def _answer(self, n: int, verdict: str) -> None:
        name = verdict_key(n)
        self._store.set(name, seal(self.config.fleet_key, self.incarnation, name, verdict.encode()))

    def _admit(self, n: int, raw: bytes) -> None:
        try:
            hello = open_hello(self.config.fleet_key, self.incarnation, n, raw)
        except (ValueError, UnicodeDecodeError) as exc:
            logger.warning(
                "%s receiver %s: refused malformed hello %d: %s",
                self.kind,
                self.incarnation,
                n,
                exc,
            )
            self._answer(n, f"receiver {self.incarnation} refused: malformed hello ({exc})")
            return
        if hello is None:
            logger.warning(
                "%s receiver %s: refused hello %d: it does not carry the fleet's secret",
                self.kind,
                self.incarnation,
                n,
            )
            self._answer(n, f"receiver {self.incarnation} {VERDICT_NO_SECRET}")
            return
        diff = self.layout.mismatch(hello.layout)
        if diff is not None:
            logger.warning(
                "%s receiver %s: refused sender %s, KV layout differs (%s)",
                self.kind,
                self.incarnation,
                hello.sender_incarnation,
                diff,
            )
            self._answer(n, f"receiver {self.incarnation} refused: KV layout differs ({diff})")
            return
        with self._pairs_lock:
            stale = [p for p in self._pairs.values() if p.sender == hello.sender_incarnation]
            self._pairs = {k: p for k, p in self._pairs.items() if p.thread.is_alive()}
        for pair in stale:
            self._stop_pair(pair)  # the sender reconnected: its old pair is dead to it
        thread = threading.Thread(
            target=self._pair_main,
            args=(n, hello.sender_incarnation),
            daemon=True,
            name=f"baton-transfer-{self.kind}-pair-{n}",
        )
        with self._pairs_lock:
            self._pairs[n] = _Pair(
                n, hello.sender_incarnation, thread, last_active=time.monotonic()
            )
        thread.start()
        self._answer(n, VERDICT_OK)

    # -- receiving --------------------------------------------------------------------------

    def _pair_main(self, n: int, sender: str) -> None:
        prefix = pair_prefix(self.incarnation, sender, n)
        ready = ready_key(prefix)
        store = self._client()
        pg = None

        def say(answer: str) -> None:
            store.set(ready, seal(self.config.fleet_key, prefix, ready, answer.encode()))

        try:
            with self._transfer.active():
                pg = self.pair_group.make(
                    store, f"{prefix}/pg", RECEIVER_RANK, self._host, self.config
                )
                self.pair_group.handshake(
                    pg, self.config.connect_timeout_s, f"pair {n} with sender {sender}"
                )
        except Exception as exc:  # noqa: BLE001 - any failure only ends this pair, typed
            logger.warning(
                "%s receiver %s: pair %d with sender %s not built: %r",
                self.kind,
                self.incarnation,
                n,
                sender,
                exc,
            )
            # The reason first: the sender may see the group fail as soon as it is let go.
            try:
                say(f"receiver {self.incarnation} could not build pair {n}: {exc!r}")
            except RuntimeError as store_exc:  # the store is going: the sender times out
                logger.warning(
                    "%s receiver %s: cannot report pair %d: %s",
                    self.kind,
                    self.incarnation,
                    n,
                    store_exc,
                )
            if pg is not None:
                release_failed_group(pg, exc)
            return
        say(READY_OK)
        logger.info(
            "%s receiver %s: sender %s connected (pair %d)", self.kind, self.incarnation, sender, n
        )
        jobs = KeySeries(store, lambda seq: job_key(prefix, seq), 0)
        with self._pairs_lock:
            pair = self._pairs[n]
            pair.jobs = jobs
            stopped = pair.stopped
        if stopped:
            return
        staging = (Staging(self.pair_group.device), Staging(self.pair_group.device))
        try:
            while (raw := jobs.take()) is not None:
                pair.last_active = time.monotonic()
                signed = open_job(self.config.fleet_key, prefix, raw)
                if signed is None:
                    raise AbortedError(f"job {jobs.position - 1} does not carry the fleet's secret")
                header = JobHeader.from_bytes(signed)
                if header.seq != jobs.position - 1:
                    raise AbortedError(f"job header seq {header.seq} under key {jobs.position - 1}")
                with self._transfer.active():  # NCCL's receive orders after this stream
                    self._receive(pg, header, staging)
        except (BatonError, ValueError) as exc:
            logger.warning(
                "%s receiver %s: pair %d with sender %s closed: %s",
                self.kind,
                self.incarnation,
                n,
                sender,
                exc,
            )
        except Exception:  # a bug or torch error: the pair is unusable, the receiver lives on
            logger.exception(
                "%s receiver %s: pair %d with sender %s failed",
                self.kind,
                self.incarnation,
                n,
                sender,
            )
        finally:
            del pg

    def _receive(
        self, pg: dist.ProcessGroup, header: JobHeader, staging: tuple[Staging, Staging]
    ) -> None:
        rid = header.request_id
        lease = self._claim(header)
        if lease is not None:
            # Scatters wait for the compute issued before the lease, and nothing later.
            self._transfer.after(self._fences.take(lease.token))
        n = len(header.block_ids)
        index = BlockIndex(header.block_ids, self._kv.device)
        groups = layer_groups(self.layout.num_layers, header.layers_per_group)
        tag = message_tag(header.seq)

        def post(g: int) -> tuple[torch.Tensor, dist.Work]:
            lo, hi = groups[g]
            nbytes = GROUP_HEADER_BYTES + group_nbytes(self.layout, lo, hi, n)
            message = staging[g % 2].bytes(nbytes)
            try:
                return message, pg.recv([message], SENDER_RANK, tag)
            except RuntimeError as exc:  # the peer is gone before the receive even started
                raise link_error(exc, f"request {rid}: receiving layer group {g}") from exc

        try:
            message, work = post(0)
            for g, (lo, hi) in enumerate(groups):
                self.pair_group.wait(
                    work,
                    pg,
                    self.config.stall_timeout_s,
                    f"request {rid}: receiving layer group {g}",
                )
                seq, group, flags, _ = self.pair_group.header(message)
                if seq != header.seq or group != g:
                    raise AbortedError(
                        f"request {rid}: got message (seq {seq}, group {group}) "
                        f"while expecting (seq {header.seq}, group {g})"
                    )
                if flags & FLAG_ABORT:
                    if lease is not None:
                        self._end_lease(lease, AbortedError(f"request {rid}: sender aborted"))
                    return
                current = message
                if g + 1 < len(groups):
                    message, work = post(g + 1)
                if lease is not None and self._begin_write(lease):
                    try:
                        self._write(current[GROUP_HEADER_BYTES:], lo, hi, index)
                    finally:
                        self._transfer.drain()  # not idle until the scatter has run
                        self._end_write(lease)
                else:
                    lease = None  # ended meanwhile: keep draining the wire, write nothing
        except Exception as exc:
            if lease is not None:
                error = (
                    exc
                    if isinstance(exc, BatonError)
                    else AbortedError(f"request {rid}: receive failed: {exc!r}")
                )
                self._end_lease(lease, error)
            raise
        if lease is not None:
            with self._cond:
                lease.arrived = True
                self._cond.notify()

    def _write(self, payload: torch.Tensor, lo: int, hi: int, index: BlockIndex) -> None:
        """Land one layer group's wire bytes in the leased blocks."""
        if self._host_kv is None:
            scatter(
                self._kv,
                lo,
                hi,
                index,
                payload.view(self._kv.dtype).view(group_shape(self.layout, lo, hi, len(index))),
            )
            return
        r0, r1 = self._host_kv.rows(lo, hi)
        rows = payload.numpy().reshape(r1 - r0, len(index), self._host_kv.row_bytes)
        self._host_kv.scatter(r0, r1, index, rows)

    def _claim(self, header: JobHeader) -> Lease | None:
        """The lease this data may land in, or None to discard it."""
        rid = header.request_id
        with self._cond:
            lease = self._leases.get(rid)
            if lease is None or lease.token != header.lease_token:
                logger.info("request %s: data for an unknown or ended lease, discarding", rid)
                return None
            if lease.ending or lease.receiving:
                logger.info("request %s: data for an ending or filled lease, discarding", rid)
                return None
            if header.epoch != lease.epoch or header.block_ids != lease.block_ids:
                lease.outcome = AbortedError(
                    f"request {rid}: sender targets epoch {header.epoch} blocks "
                    f"{header.block_ids}, lease has epoch {lease.epoch} blocks {lease.block_ids}"
                )
                self._cond.notify()
                return None
            lease.receiving = True
            return lease

    def _begin_write(self, lease: Lease) -> bool:
        with self._cond:
            if lease.ending:
                return False
            lease.busy = True
            return True

    def _end_write(self, lease: Lease) -> None:
        with self._cond:
            lease.busy = False
            self._cond.notify()


class GlooLink(PeerLink):
    """A sender's pair group with one receiver incarnation, plus its store connection."""

    def __init__(
        self,
        store: dist.TCPStore,
        pg: dist.ProcessGroup,
        prefix: str,
        incarnation: str,
        kv: torch.Tensor,
        layout: KVLayout,
        config: TransferConfig,
        pair_group: PairGroup,
        address: str,
        transfer: TransferStream,
        fences: FenceBook,
        sign: FleetKey | None = None,
    ) -> None:
        self.incarnation = incarnation
        self._sign = sign  # the receiver requires tagged job headers
        self._address = address
        self._transfer = transfer
        self._fences = fences
        self._store: dist.TCPStore | None = store
        self._pg: dist.ProcessGroup | None = pg
        self._prefix = prefix
        self._kv = kv
        self._layout = layout
        self._config = config
        self._pair_group = pair_group
        self._seq = 0
        self._staging = (Staging(pair_group.device), Staging(pair_group.device))
        self._host_kv = HostPool(kv) if kv.device.type == "cpu" else None

    def send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        with self._transfer.active():  # gathers and NCCL sends off the compute stream
            self._transfer.after(self._fences.take(job.request_id))
            return self._send(job, stop)

    def _send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        assert self._pg is not None and self._store is not None
        pg = self._pg
        desc = job.descriptor
        n = len(desc.block_ids)
        per_group = layers_per_group(self._layout, n, self._config.group_bytes)
        groups = layer_groups(self._layout.num_layers, per_group)
        header = JobHeader(
            self._seq, job.request_id, desc.epoch, desc.lease_token, per_group, desc.block_ids
        )
        self._seq += 1
        src = BlockIndex(job.src_block_ids, self._kv.device)
        tag = message_tag(header.seq)
        checksum = KVChecksum()
        nbytes = 0
        inflight: deque[dist.Work] = deque()
        stopped: BatonError | None = None

        def wait_oldest() -> None:
            remaining = min(self._config.stall_timeout_s, job.deadline - time.monotonic())
            what = f"request {job.request_id}: sending"
            try:
                self._pair_group.wait(inflight.popleft(), pg, remaining, what)
            except BatonError as exc:
                self.broken = True
                raise past_deadline(exc, job.deadline, what) from exc

        raw = header.to_bytes()
        if self._sign is not None:
            raw = sign_job(self._sign, self._prefix, raw)
        try:
            self._store.set(job_key(self._prefix, header.seq), raw)
        except RuntimeError as exc:
            self.broken = True
            raise link_error(exc, f"request {job.request_id}: announcing the job") from exc
        for g, (lo, hi) in enumerate(groups):
            try:
                stop(g)
            except BatonError as exc:
                stopped = exc
            if len(inflight) == 2:
                wait_oldest()  # frees this group's staging buffer
            size = group_nbytes(self._layout, lo, hi, n)
            message = self._staging[g % 2].bytes(GROUP_HEADER_BYTES + size)
            flags = FLAG_ABORT if stopped is not None else 0
            self._pair_group.set_header(message, [header.seq, g, flags, size])
            if stopped is None:
                payload = message[GROUP_HEADER_BYTES:]
                if self._host_kv is not None:  # gathered and hashed a cache-sized piece at a time
                    self._host_kv.stream(lo, hi, src, checksum, out=payload.numpy())
                else:
                    staged = payload.view(self._kv.dtype).view(group_shape(self._layout, lo, hi, n))
                    gather(self._kv, lo, hi, src, staged)
                    checksum.update(staged)
                nbytes += size
            try:
                inflight.append(pg.send([message], RECEIVER_RANK, tag))
            except RuntimeError as exc:  # the peer is gone before the send even started
                self.broken = True
                raise link_error(exc, f"request {job.request_id}: sending") from exc
            if stopped is not None:
                break  # the abort message ends the job on the wire
        while inflight:
            wait_oldest()
        if stopped is not None:
            raise stopped
        return checksum.value, nbytes

    def gone(self) -> bool:
        # A receiver's store dies with it: a refused connection means the process is
        # gone. Anything else (it answers, or the host is slow) says nothing; the idle
        # bound covers those.
        host, port = parse_address(self._address)
        try:
            socket.create_connection((host, port), timeout=0.5).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False

    def close(self) -> None:
        self._pg = None
        self._store = None


class GlooSender(QueuedSender):
    """Sends to receivers anywhere over gloo pair groups."""

    kind = "gloo"
    pair_group: PairGroup = PairGroup()

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: TransferConfig | None = None,
        notify: Notify | None = None,
    ) -> None:
        self._transfer = TransferStream(kv_cache.device)
        self._fences = FenceBook(self._transfer)  # per request: compute before its submit
        super().__init__(kv_cache, layout, config, notify)

    def submit(self, job: SendJob) -> None:
        self._fences.record(job.request_id)
        try:
            super().submit(job)
        except BaseException:
            self._fences.take(job.request_id)
            raise

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self._fences.take(request_id)

    def _connect(self, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        host, port = parse_address(endpoint.address)
        budget = min(self.config.connect_timeout_s, deadline - time.monotonic())
        if budget <= 0:
            raise DeadlineExceededError(f"no time left to connect to {endpoint.address}")
        try:
            store = client_store(host, port, budget)
        except RuntimeError as exc:
            raise UnavailableError(
                f"receiver store at {endpoint.address} unreachable: {exc}"
            ) from exc
        try:
            return self._handshake(store, endpoint, host, deadline)
        except RuntimeError as exc:
            raise link_error(exc, f"handshake with {endpoint.address}") from exc

    def _handshake(
        self, store: dist.TCPStore, endpoint: KVEndpoint, host: str, deadline: float
    ) -> GlooLink:
        key = self.config.fleet_key
        if key is None and store.check([KEY_AUTH]):
            raise PermissionDeniedError(
                f"receiver {endpoint.incarnation} at {endpoint.address} admits only senders "
                "holding the fleet's secret, and this one has none (--fleet-secret-file)"
            )
        sealed = unseal(key, "", KEY_INCARNATION, store.get(KEY_INCARNATION))
        if sealed is None:
            raise PermissionDeniedError(
                f"the receiver at {endpoint.address} does not prove it holds the fleet's "
                "secret (its incarnation record is not sealed with it)"
            )
        live = sealed.decode()
        if live != endpoint.incarnation:
            raise UnavailableError(
                f"{endpoint.address} is receiver {live}, descriptor names "
                f"{endpoint.incarnation} (restarted)"
            )
        layout = unseal(key, live, KEY_LAYOUT, store.get(KEY_LAYOUT))
        if layout is None:
            raise PermissionDeniedError(
                f"receiver {live} at {endpoint.address}: its layout "
                "record does not carry the fleet's secret"
            )
        diff = self.layout.mismatch(decode_layout(layout))
        if diff is not None:
            raise LayoutMismatchError(
                f"receiver {live} at {endpoint.address} has a different KV layout ({diff})"
            )
        n = store.add(KEY_HELLO_COUNT, 1)
        hello = Hello(self.incarnation, self.layout).to_bytes()
        if key is not None:
            hello = sign_hello(key, live, n, hello)
        store.set(hello_key(n), hello)
        store.set(KEY_HELLO_BELL, b"1")  # wakes the receiver whatever our number
        # Bounded by the connect timeout, not the job's deadline: a receiver that does not
        # answer is a silent peer (retryable), and this lane may hold other jobs to it.
        budget = min(self.config.connect_timeout_s, deadline - time.monotonic())
        try:
            answer = read_sealed(store, verdict_key(n), key, live, budget)
        except dist.DistStoreError as exc:
            silent = AbortedError(f"receiver {live} did not answer hello {n} within {budget:.1f} s")
            raise past_deadline(silent, deadline, f"hello {n}") from exc
        store.delete_key(verdict_key(n))
        if answer is None:
            raise PermissionDeniedError(
                f"receiver {live}: no verdict on hello {n} carried "
                f"the fleet's secret within {budget:.1f} s"
            )
        verdict = answer.decode()
        if verdict.endswith(VERDICT_NO_SECRET):
            raise PermissionDeniedError(verdict)
        if verdict != VERDICT_OK:
            raise LayoutMismatchError(verdict)
        prefix = pair_prefix(live, self.incarnation, n)
        ready = ready_key(prefix)

        def refused() -> str | None:
            if not store.check([ready]):
                return None
            answer = unseal(key, prefix, ready, store.get(ready))
            # A forged answer is no answer: the receiver's own overwrites it.
            return None if answer is None or answer == READY_OK.encode() else answer.decode()

        what = f"pair {n} with receiver {live}"
        budget = max(min(self.config.connect_timeout_s, deadline - time.monotonic()), 0.001)
        pg = None
        try:
            with self._transfer.active():
                pg = self.pair_group.make(
                    store, f"{prefix}/pg", SENDER_RANK, local_address_towards(host), self.config
                )
                self.pair_group.handshake(pg, budget, what, refused)
            sealed_answer = read_sealed(store, ready, key, prefix, budget)
        except Exception as exc:
            if pg is not None:
                release_failed_group(pg, exc)
                pg = None
            if isinstance(exc, BatonError):
                raise past_deadline(exc, deadline, what) from exc
            reason = refused()  # whatever broke the group, typed
            raise UnavailableError(f"{what}: {reason or repr(exc)}") from exc
        store.delete_key(ready)
        answer = (
            f"receiver {live}: no readiness record carried the fleet's secret"
            if sealed_answer is None
            else sealed_answer.decode()
        )
        if answer != READY_OK:
            release_failed_group(pg, UnavailableError(answer))
            raise UnavailableError(f"{what}: {answer}")
        logger.info(
            "%s sender %s: joined receiver %s at %s (pair %d)",
            self.kind,
            self.incarnation,
            live,
            endpoint.address,
            n,
        )
        return GlooLink(
            store,
            pg,
            prefix,
            live,
            self.kv_cache,
            self.layout,
            self.config,
            self.pair_group,
            endpoint.address,
            self._transfer,
            self._fences,
            key,
        )
