"""The ``nixl`` transport: prefill WRITEs straight into decode's leased blocks with NVIDIA NIXL.

Each worker owns one NIXL agent (UCX backend: shared memory or TCP between CPU
processes; CUDA IPC, NVLink or RDMA between GPUs). Decode registers its whole pool once
and hands its agent metadata and the pool's address out in every descriptor's endpoint
handle (``nixl_wire.PoolHandle``), so the fleet's signature on the order covers them and
no rendezvous service exists. A sender loads that metadata, says hello with its own
(signed), and then moves each lease as one NIXL WRITE: one strided descriptor per run of
blocks consecutive in both pools, covering every (layer, k/v, head) row of the run.

Leases follow ``nixl_wire``'s claim protocol: a sender writes a lease only between the
receiver's GRANT and the transfer's own DONE notification (delivered after the data) or
its RELEASE. A lease that ends while granted is revoked (REVOKE): a sender that has not
posted yet posts nothing, one mid-transfer cancels it with NIXL (releasing an active
transfer handle cancels it) and then releases. Until DONE or RELEASE arrives, the
lease's blocks are quarantined, however long that takes, unless the writer is known dead
(``forget_sender``, or on this host its liveness lock, ``writer_liveness``).
The receiver lives in ``nixl_receiver``; this module is the sender.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from engine.errors import (
    AbortedError,
    BatonError,
    DeadlineExceededError,
    LayoutMismatchError,
    PermissionDeniedError,
    UnavailableError,
)
from engine.kv_layout import DTYPE_SIZES, KVLayout
from engine.transfer.base import KVEndpoint, Notify, SendJob, TransferConfig
from engine.transfer.block_copy import HostPool, Staging, checksum_blocks
from engine.transfer.nixl_agent import Inbox, agent_name, host_id, make_agent, mem_type
from engine.transfer.nixl_wire import (
    CLAIM,
    DONE,
    GRANT,
    HELLO,
    PING,
    REFUSE,
    RELEASE,
    REVOKE,
    WELCOME,
    Message,
    PoolHandle,
    block_runs,
    claim_fields,
    hello_fields,
    proof,
    receiver_agent_name,
    sender_agent_name,
)
from engine.transfer.queued_sender import PeerLink, QueuedSender, StopCheck
from engine.transfer.writer_liveness import WriterLock

logger = logging.getLogger(__name__)

_BUSY_POLL_S = 0.0005  # how often a waiting sender polls its transfer
# While a transfer is in flight the sender counts a beat this often (NIXL reports no
# partial progress); the stall bound still ends a transfer that never completes.
_BEAT_S = 0.05


class NixlLink(PeerLink):
    """A loaded receiver agent; each job is one WRITE into its pool."""

    def __init__(
        self, sender: NixlSender, endpoint: KVEndpoint, handle: PoolHandle, agent_name: str
    ) -> None:
        self.incarnation = endpoint.incarnation
        self._sender = sender
        self._handle = handle
        self._agent_name = agent_name
        self._num_blocks = endpoint.num_blocks

    def send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        s = self._sender
        desc = job.descriptor
        checksum = s.checksum(job.src_block_ids)  # before the claim: the grant stays short
        nbytes = len(desc.block_ids) * s.layout.block_bytes
        claim = Message(
            CLAIM,
            self.incarnation,
            s.incarnation,
            desc.lease_token,
            claim_fields(job.request_id, desc.epoch, desc.block_ids),
        )
        s.tell(self._agent_name, claim)
        until = min(job.deadline, time.monotonic() + s.config.stall_timeout_s)
        try:
            answer = s.inbox.wait(
                (GRANT, REFUSE),
                self.incarnation,
                desc.lease_token,
                until,
                f"request {job.request_id}: receiver {self.incarnation} on the claim",
            )
        except UnavailableError as exc:
            # Silent: a grant may still come, so say we are done with the lease anyway.
            self._release(job, "no grant in time")
            raise AbortedError(str(exc)) from exc
        if answer.kind == REFUSE:
            raise AbortedError(answer.fields[0].decode() if answer.fields else "claim refused")
        try:
            stop(0)
            self._check_revoked(job)
            self._write(job, stop)
        except BaseException as exc:
            self._release(job, repr(exc) if not isinstance(exc, BatonError) else str(exc))
            raise
        finally:
            s.inbox.discard(self.incarnation, desc.lease_token)
        return checksum, nbytes

    def _check_revoked(self, job: SendJob) -> None:
        s = self._sender
        s.inbox.pump()
        if s.inbox.take((REVOKE,), self.incarnation, job.descriptor.lease_token) is not None:
            raise AbortedError(
                f"request {job.request_id}: destination lease was revoked (cancelled, "
                "expired or superseded); nothing more written"
            )

    def _write(self, job: SendJob, stop: StopCheck) -> None:
        """Post the lease's one WRITE and wait for it; cancel it with NIXL when stopped."""
        s = self._sender
        desc = job.descriptor
        local, remote = s.descriptors(
            job.src_block_ids, desc.block_ids, self._handle, self._num_blocks
        )
        done = Message(DONE, self.incarnation, s.incarnation, desc.lease_token).encode(
            s.config.fleet_key
        )
        agent = s.agent
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, s.mem)
        remote_h = agent.prep_xfer_dlist(self._agent_name, remote, self._handle.mem_type)
        xfer = None
        try:
            count = int(local[:, 4].sum())
            index = np.arange(count, dtype=np.int32)
            xfer = agent.make_prepped_xfer("WRITE", local_h, index, remote_h, index, done)
            state = agent.transfer(xfer)
            started = time.monotonic()
            beat = started + _BEAT_S
            group = 1
            while state == "PROC":
                now = time.monotonic()
                try:
                    if now >= beat:
                        stop(group)
                        group += 1
                        beat = now + _BEAT_S
                    self._check_revoked(job)
                    if now - started > s.config.stall_timeout_s:
                        raise AbortedError(
                            f"request {job.request_id}: the transfer made no progress for "
                            f"{s.config.stall_timeout_s:.1f} s"
                        )
                except BaseException:
                    self._cancel(job, xfer)
                    xfer = None
                    raise
                time.sleep(_BUSY_POLL_S)
                state = agent.check_xfer_state(xfer)
            if state != "DONE":
                self.broken = True
                raise UnavailableError(
                    f"request {job.request_id}: NIXL reported the transfer failed"
                )
            agent.release_xfer_handle(xfer)
            xfer = None
        finally:
            if xfer is not None:
                self._cancel(job, xfer)
            local_h.release()
            remote_h.release()

    def _cancel(self, job: SendJob, xfer: Any) -> None:
        """Cancel an in-flight transfer (NIXL aborts an active one on release); if NIXL
        cannot, wait it out within the stall bound; if it never ends, the link is broken
        and no RELEASE goes out, so the receiver keeps the blocks quarantined."""
        agent = self._sender.agent
        end = time.monotonic() + self._sender.config.stall_timeout_s
        while True:
            try:
                agent.release_xfer_handle(xfer)
                return
            except Exception as exc:  # noqa: BLE001 - NIXL could not cancel yet
                if time.monotonic() > end:
                    self.broken = True
                    raise AbortedError(
                        f"request {job.request_id}: NIXL could neither cancel nor finish the "
                        f"transfer ({exc!r}); its blocks stay quarantined"
                    ) from exc
            if agent.check_xfer_state(xfer) != "PROC":
                try:
                    agent.release_xfer_handle(xfer)
                except Exception:  # noqa: BLE001
                    logger.exception("request %s: releasing a finished transfer", job.request_id)
                return
            time.sleep(_BUSY_POLL_S)

    def _release(self, job: SendJob, reason: str) -> None:
        msg = Message(
            RELEASE,
            self.incarnation,
            self._sender.incarnation,
            job.descriptor.lease_token,
            (reason.encode(),),
        )
        try:
            self._sender.tell(self._agent_name, msg)
        except BatonError:
            self.broken = True

    def gone(self) -> bool:
        # UCX fails a send to a receiver whose process is gone (remote disconnect); a live
        # one drops the ping unread.
        try:
            self._sender.tell(
                self._agent_name, Message(PING, self.incarnation, self._sender.incarnation)
            )
        except UnavailableError:
            return True
        return False

    def close(self) -> None:
        self._sender.forget_receiver(self._agent_name, self.incarnation)


class NixlSender(QueuedSender):
    """Writes into receivers' registered pools with this worker's NIXL agent."""

    kind = "nixl"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: TransferConfig | None = None,
        notify: Notify | None = None,
    ) -> None:
        super().__init__(kv_cache, layout, config, notify)
        self.agent = make_agent(sender_agent_name(self.incarnation))
        self._registered = self.agent.register_memory([kv_cache])
        self.mem, self._device_id = mem_type(kv_cache)
        self.inbox = Inbox(self.agent, self.config.fleet_key, self.incarnation)
        self._writer_lock = WriterLock(self.incarnation)
        self._host = host_id()
        self._staging = Staging(kv_cache.device)
        self._host_pool = HostPool(kv_cache) if kv_cache.device.type == "cpu" else None
        self._checksum_lock = threading.Lock()
        dtype_size = DTYPE_SIZES[layout.dtype]
        self._row_bytes = layout.block_size * layout.head_dim * dtype_size
        self._rows = layout.num_layers * 2 * layout.num_kv_heads
        weakref.finalize(self, _close_at_exit, weakref.ref(self))

    def close(self) -> None:
        super().close()
        if not any(thread.is_alive() for thread in self._threads):
            self._writer_lock.close()
            if self._registered is not None:
                try:
                    self.agent.deregister_memory(self._registered)
                except Exception as exc:  # noqa: BLE001
                    logger.warning("nixl sender %s: deregistering: %r", self.incarnation, exc)
                self._registered = None

    def checksum(self, src_block_ids: tuple[int, ...]) -> int:
        """The checksum of the source blocks in wire order (what the receiver recomputes)."""
        with self._checksum_lock:  # one staging buffer, lanes in parallel
            return checksum_blocks(
                self.kv_cache,
                self.layout,
                src_block_ids,
                self.config.group_bytes,
                self._staging,
                self._host_pool,
            )

    def descriptors(
        self, src: tuple[int, ...], dst: tuple[int, ...], handle: PoolHandle, dst_blocks: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Strided (address, length, device, stride, count) rows, one per run of blocks
        consecutive in both pools, each covering that run in every (layer, k/v, head) row."""
        runs = block_runs(src, dst)
        rb, rows = self._row_bytes, self._rows
        base = self.kv_cache.data_ptr()
        local = np.array(
            [
                [base + s * rb, n * rb, self._device_id, self.num_blocks * rb, rows]
                for s, _, n in runs
            ],
            dtype=np.uint64,
        )
        remote = np.array(
            [
                [handle.address + d * rb, n * rb, handle.device_id, dst_blocks * rb, rows]
                for _, d, n in runs
            ],
            dtype=np.uint64,
        )
        return local, remote

    def tell(self, agent_name: str, msg: Message) -> None:
        try:
            self.agent.send_notif(agent_name, msg.encode(self.config.fleet_key))
        except Exception as exc:  # noqa: BLE001 - typed for the lane
            raise UnavailableError(f"receiver {msg.receiver} unreachable: {exc!r}") from exc

    def forget_receiver(self, agent_name: str, incarnation: str) -> None:
        self.inbox.forget(incarnation)
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception as exc:  # noqa: BLE001 - not loaded, or gone already
            logger.debug("nixl sender: removing agent %s: %r", agent_name, exc)

    def _connect(self, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        try:
            handle = PoolHandle.from_bytes(endpoint.handle)
        except ValueError as exc:
            raise UnavailableError(f"receiver {endpoint.incarnation}: {exc}") from exc
        key = self.config.fleet_key
        if handle.proof and key is None:
            raise PermissionDeniedError(
                f"receiver {endpoint.incarnation} admits only senders holding the fleet's "
                "secret, and this one has none (--fleet-secret-file)"
            )
        if key is not None and not hmac.compare_digest(
            handle.proof, proof(key, endpoint.incarnation, handle.metadata)
        ):
            raise PermissionDeniedError(
                f"receiver {endpoint.incarnation} at {endpoint.address} does not prove it "
                "holds the fleet's secret"
            )
        if handle.mem_type != self.mem:
            raise LayoutMismatchError(
                f"receiver {endpoint.incarnation} keeps its pool in {handle.mem_type}, "
                f"ours is in {self.mem}"
            )
        expected = receiver_agent_name(endpoint.incarnation)
        budget = min(self.config.connect_timeout_s, deadline - time.monotonic())
        if budget <= 0:
            raise DeadlineExceededError(f"no time left to connect to {endpoint.address}")
        try:
            name = agent_name(self.agent.add_remote_agent(handle.metadata))
        except Exception as exc:  # noqa: BLE001 - bad or stale metadata
            raise UnavailableError(
                f"receiver {endpoint.incarnation}: cannot load its metadata: {exc!r}"
            ) from exc
        if name != expected:
            self.forget_receiver(name, endpoint.incarnation)
            raise UnavailableError(
                f"the metadata at {endpoint.address} is agent {name}, descriptor names "
                f"receiver {endpoint.incarnation} (restarted)"
            )
        hello = Message(
            HELLO,
            endpoint.incarnation,
            self.incarnation,
            0,
            hello_fields(
                self.agent.get_agent_metadata(), self.layout, self._writer_lock.id, self._host
            ),
        )
        try:
            self.tell(name, hello)
            answer = self.inbox.wait(
                (WELCOME, REFUSE),
                endpoint.incarnation,
                0,
                time.monotonic() + budget,
                f"receiver {endpoint.incarnation} at {endpoint.address} on hello",
            )
        except UnavailableError as exc:
            self.forget_receiver(name, endpoint.incarnation)
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(str(exc)) from exc
            raise AbortedError(f"{exc} (restarted or gone?)") from exc
        if answer.kind == REFUSE:
            self.forget_receiver(name, endpoint.incarnation)
            raise LayoutMismatchError(answer.fields[0].decode() if answer.fields else "refused")
        logger.info("nixl sender %s: joined receiver %s", self.incarnation, endpoint.incarnation)
        return NixlLink(self, endpoint, handle, name)


def _close_at_exit(sender: weakref.ref[NixlSender]) -> None:
    live = sender()
    if live is not None:
        live.close()
