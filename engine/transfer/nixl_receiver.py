"""The decode side of the ``nixl`` transport: the pool registered with the worker's agent.

The receiver grants, watches and ends leases by the claim protocol of ``nixl_wire``: its
mail thread answers hellos (loading the sender's metadata) and claims, and marks a
lease idle on the transfer's DONE notification or the sender's RELEASE. A lease that
ends while granted is revoked (REVOKE to its writer) and stays quarantined until one of
those arrives or the writer is known dead: forgotten (``forget_sender``: it restarted or
left) or, on this host, no longer holding its liveness lock (``writer_liveness``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from engine.errors import AbortedError
from engine.kv_layout import KVLayout
from engine.transfer.base import KVEndpoint, Notify, TransferConfig
from engine.transfer.block_copy import torch_dtype
from engine.transfer.lease_receiver import Lease, LeaseReceiver
from engine.transfer.nixl_agent import Inbox, agent_name, host_id, make_agent, mem_type
from engine.transfer.nixl_wire import (
    CLAIM,
    DONE,
    GRANT,
    HELLO,
    REFUSE,
    RELEASE,
    REVOKE,
    WELCOME,
    Hello,
    Message,
    PoolHandle,
    parse_claim,
    proof,
    receiver_agent_name,
    sender_agent_name,
)
from engine.transfer.writer_liveness import writer_alive

logger = logging.getLogger(__name__)

_BUSY_POLL_S = 0.0005  # the mail thread drains notifications this often while leases live
_IDLE_POLL_S = 0.02  # and this often with none (a new lease wakes it at once)


@dataclass(slots=True)
class _Writer:
    """A sender incarnation that said hello."""

    agent: str
    writer_id: int
    same_host: bool
    dead: bool = False


class NixlReceiver(LeaseReceiver):
    """Decode's pool registered with its own NIXL agent; senders write into granted leases."""

    kind = "nixl"

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        address: str = "",
        config: TransferConfig | None = None,
        notify: Notify | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__(layout, num_blocks, config, notify)
        self._agent = make_agent(receiver_agent_name(self.incarnation))
        self._kv = torch.zeros(
            layout.pool_shape(num_blocks), dtype=torch_dtype(layout), device=device
        )
        self._registered = self._agent.register_memory([self._kv])
        mem, device_id = mem_type(self._kv)
        metadata = self._agent.get_agent_metadata()
        key = self.config.fleet_key
        handle = PoolHandle(
            metadata,
            self._kv.data_ptr(),
            mem,
            device_id,
            proof(key, self.incarnation, metadata) if key is not None else b"",
        )
        # The address names the pool for humans and for senders' lanes: one per incarnation.
        self._endpoint = KVEndpoint(
            self.kind,
            address or receiver_agent_name(self.incarnation),
            self.incarnation,
            layout,
            num_blocks,
            handle.to_bytes(),
        )
        self._inbox = Inbox(self._agent, self.config.fleet_key, self.incarnation)
        self._writers: dict[str, _Writer] = {}  # sender incarnation -> its agent
        self._granted: dict[int, str] = {}  # lease token -> the sender writing it
        self._by_token: dict[int, Lease] = {}
        self._host = host_id()
        self._stop_mail = threading.Event()
        self._mail_wake = threading.Event()
        self._mail = threading.Thread(
            target=self._mail_main, daemon=True, name="baton-transfer-nixl-mail"
        )
        self._mail.start()
        self._start_worker()
        logger.info(
            "nixl receiver %s: pool of %d blocks registered (%s)",
            self.incarnation,
            num_blocks,
            mem,
        )

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv

    @property
    def endpoint(self) -> KVEndpoint:
        return self._endpoint

    @property
    def num_pairs(self) -> int:
        """Senders admitted (their hello checked, their agent loaded) and not forgotten."""
        with self._cond:
            return sum(1 for writer in self._writers.values() if not writer.dead)

    # -- lease hooks ------------------------------------------------------------------------

    def _arm(self, lease: Lease) -> None:
        self._by_token[lease.token] = lease
        self._mail_wake.set()  # its claim comes next: stop idling

    def _revoke(self, lease: Lease) -> None:
        writer = self._granted.get(lease.token)
        if writer is not None:
            self._send(writer, Message(REVOKE, self.incarnation, writer, lease.token))

    def _writers_idle(self, lease: Lease) -> bool:
        idle = lease.token not in self._granted
        if idle:
            self._by_token.pop(lease.token, None)
        return idle

    def _data_ready(self, lease: Lease) -> bool:
        return lease.arrived

    def _clear_dead_writers(self, lease: Lease) -> bool:
        sender = self._granted.get(lease.token)
        if sender is None:
            return True
        writer = self._writers.get(sender)
        dead = writer is None or writer.dead
        if writer is not None and not dead and writer.same_host:
            dead = not writer_alive(writer.writer_id)
        if not dead:
            return False
        logger.warning(
            "request %s: sender %s died holding the lease's grant; cleared",
            lease.request_id,
            sender,
        )
        self._granted.pop(lease.token, None)
        return self._writers_idle(lease)

    def forget_sender(self, sender_incarnation: str) -> None:
        with self._cond:
            writer = self._writers.get(sender_incarnation)
            if writer is None:
                return
            writer.dead = True  # restarted or gone: its grants hold nothing any more
            self._cond.notify()
        logger.info("nixl receiver %s: forgetting sender %s", self.incarnation, sender_incarnation)
        try:
            self._agent.remove_remote_agent(writer.agent)
        except Exception as exc:  # noqa: BLE001 - already gone: nothing to undo
            logger.debug("nixl: removing agent %s: %r", writer.agent, exc)

    def _shutdown(self) -> None:
        self._stop_mail.set()
        self._mail_wake.set()
        self._mail.join()
        try:
            self._agent.deregister_memory(self._registered)
        except Exception as exc:  # noqa: BLE001 - the agent goes next anyway
            logger.warning("nixl receiver %s: deregistering the pool: %r", self.incarnation, exc)
        self._agent = self._inbox = None  # the agent goes with its last reference

    # -- notifications ----------------------------------------------------------------------

    def _mail_main(self) -> None:
        while not self._stop_mail.is_set():
            messages = self._inbox.drain()
            for msg in messages:
                try:
                    self._handle(msg)
                except Exception:  # noqa: BLE001 - one bad message never stops the mail
                    logger.exception("nixl receiver %s: handling a %r", self.incarnation, msg.kind)
            if not messages:
                with self._cond:
                    busy = bool(self._leases)
                self._mail_wake.wait(_BUSY_POLL_S if busy else _IDLE_POLL_S)
                self._mail_wake.clear()

    def _handle(self, msg: Message) -> None:
        if msg.receiver != self.incarnation:
            logger.info(
                "nixl: a message for receiver %s reached %s", msg.receiver, self.incarnation
            )
            return
        if msg.kind == HELLO:
            self._hello(msg)
        elif msg.kind == CLAIM:
            self._claim(msg)
        elif msg.kind in (DONE, RELEASE):
            self._let_go(msg)

    def _send(self, sender: str, msg: Message) -> None:
        writer = self._writers.get(sender)
        if writer is None or writer.dead:
            return
        try:
            self._agent.send_notif(writer.agent, msg.encode(self.config.fleet_key))
        except Exception as exc:  # noqa: BLE001 - a sender that is gone needs no answer
            logger.info("nixl: cannot tell sender %s: %r", sender, exc)

    def _hello(self, msg: Message) -> None:
        hello = Hello.from_message(msg)
        agent = agent_name(self._agent.add_remote_agent(hello.metadata))
        if agent != sender_agent_name(msg.sender):
            logger.warning("nixl: hello from %s carries the metadata of %s", msg.sender, agent)
            self._agent.remove_remote_agent(agent)
            return
        with self._cond:
            self._writers[msg.sender] = _Writer(agent, hello.writer_id, hello.host_id == self._host)
        diff = hello.layout.mismatch(self.layout)  # as the sender sees it: ours != theirs
        if diff is not None:
            reason = f"receiver {self.incarnation} refused: KV layout differs ({diff})"
            self._send(
                msg.sender, Message(REFUSE, self.incarnation, msg.sender, 0, (reason.encode(),))
            )
            return
        logger.info("nixl receiver %s: sender %s said hello", self.incarnation, msg.sender)
        self._send(msg.sender, Message(WELCOME, self.incarnation, msg.sender))

    def _claim(self, msg: Message) -> None:
        request_id, epoch, block_ids = parse_claim(msg)
        refusal = None
        with self._cond:
            writer = self._writers.get(msg.sender)
            lease = self._leases.get(request_id)
            if writer is None or writer.dead:
                return  # not introduced: no way to answer
            if lease is None or lease.token != msg.token or lease.ending:
                refusal = (
                    f"request {request_id}: destination lease was revoked (cancelled, "
                    "expired or superseded)"
                )
            elif lease.receiving:
                refusal = f"request {request_id}: the lease was already written"
            elif epoch != lease.epoch or block_ids != lease.block_ids:
                lease.outcome = AbortedError(
                    f"request {request_id}: sender targets epoch {epoch} blocks {block_ids}, "
                    f"lease has epoch {lease.epoch} blocks {lease.block_ids}"
                )
                refusal = str(lease.outcome)
                self._cond.notify()
            else:
                lease.receiving = True
                self._granted[lease.token] = msg.sender
        kind, fields = (GRANT, ()) if refusal is None else (REFUSE, (refusal.encode(),))
        self._send(msg.sender, Message(kind, self.incarnation, msg.sender, msg.token, fields))

    def _let_go(self, msg: Message) -> None:
        with self._cond:
            if self._granted.get(msg.token) != msg.sender:
                return
            del self._granted[msg.token]
            lease = self._by_token.get(msg.token)
            if lease is not None:
                if msg.kind == DONE:
                    lease.arrived = True
                elif not lease.ending:
                    reason = msg.fields[0].decode() if msg.fields else "no reason"
                    lease.outcome = AbortedError(
                        f"request {lease.request_id}: sender aborted the transfer: {reason}"
                    )
            self._cond.notify()
