"""One worker's NIXL agent: made once, its pool registered once, its notifications sorted.

NIXL (``nixl_cu12``, the optional ``nixl`` extra) is imported only when an agent is
made, so a worker on another transport never needs it. The agent uses the UCX backend,
which picks shared memory or TCP between CPU processes and CUDA IPC, NVLink or RDMA
between GPUs (``UCX_TLS`` / ``UCX_NET_DEVICES`` narrow that choice). NIXL's own logger
writes to stdout; it is handed to ours so a worker's stdout stays its own.

Notifications arrive at the agent, not at the thread that waits for them: ``Inbox``
drains the agent (one thread at a time) and files each decoded message under what it
answers, so each waiter takes only its own.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import defaultdict, deque
from typing import Any

import torch

from engine.errors import UnavailableError
from engine.transfer.fleet_auth import FleetKey
from engine.transfer.nixl_wire import Message, receiver_agent_name, sender_agent_name

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps nixl-cu12 (the baton[nixl] extra)"
_POLL_S = 0.0005  # how often a waiter drains the agent: a notification is a lease's latency


def nixl_available() -> bool:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return False
    return True


def make_agent(name: str) -> Any:
    """A NIXL agent named ``name`` on the UCX backend, safe to call from several threads."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError as exc:
        raise RuntimeError(f"the nixl transport needs NIXL: {INSTALL_HINT} ({exc})") from exc
    nixl_logger = logging.getLogger("nixl")
    nixl_logger.handlers.clear()  # it prints to stdout; let ours decide
    nixl_logger.propagate = True
    config = nixl_agent_config(
        enable_prog_thread=False,  # we poll; a progress thread costs a core (3-10x latency here)
        backends=["UCX"],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise RuntimeError(f"NIXL has no UCX backend here (plugins: {agent.plugin_list})")
    return agent


def host_id() -> str:
    """This host's identity for writer liveness: the kernel's boot id and the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def agent_name(name: str | bytes) -> str:
    """NIXL hands agent names back as bytes."""
    return name.decode() if isinstance(name, bytes) else name


def mem_type(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id for ``tensor``."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


class Inbox:
    """The decoded notifications of one agent, filed by (kind, peer incarnation, token)."""

    def __init__(self, agent: Any, key: FleetKey | None, me: str) -> None:
        self._agent = agent
        self._key = key
        self._me = me  # our incarnation: a message naming another is not for us
        self._drain_lock = threading.Lock()
        self._lock = threading.Lock()
        self._boxes: dict[tuple[bytes, str, int], deque[Message]] = defaultdict(deque)

    def drain(self) -> list[Message]:
        """Fetch what arrived; return the messages nobody waits on by key (all of them:
        the caller files or handles them). Malformed or unsigned ones are dropped."""
        with self._drain_lock:
            try:
                raw = self._agent.get_new_notifs()
            except Exception as exc:  # noqa: BLE001 - the agent is going away: no mail
                logger.debug("nixl: reading notifications failed: %r", exc)
                return []
        out = []
        for source, messages in raw.items():
            for data in messages:
                try:
                    msg = Message.decode(bytes(data), self._key)
                except ValueError as exc:
                    logger.warning("nixl: dropped a notification from %s: %s", source, exc)
                    continue
                author = (
                    receiver_agent_name(msg.receiver)
                    if msg.sender == self._me
                    else sender_agent_name(msg.sender)
                )
                if agent_name(source) != author:
                    logger.warning(
                        "nixl: dropped a %r that %s sent as %s", msg.kind, source, author
                    )
                    continue
                out.append(msg)
        return out

    def discard(self, peer: str, token: int) -> None:
        """Drop whatever is filed about ``token`` (a revocation that came too late)."""
        with self._lock:
            for key in [k for k in self._boxes if k[1] == peer and k[2] == token]:
                del self._boxes[key]

    def file(self, msg: Message, peer: str) -> None:
        with self._lock:
            self._boxes[(msg.kind, peer, msg.token)].append(msg)

    def take(self, kinds: tuple[bytes, ...], peer: str, token: int) -> Message | None:
        with self._lock:
            for kind in kinds:
                box = self._boxes.get((kind, peer, token))
                if box:
                    msg = box.popleft()
                    if not box:
                        del self._boxes[(kind, peer, token)]
                    return msg
        return None

    def pump(self) -> None:
        """Drain the agent and file every message for us under its sender's peer."""
        for msg in self.drain():
            if msg.sender == self._me:  # we are the sender: file under the receiver
                self.file(msg, msg.receiver)

    def wait(
        self, kinds: tuple[bytes, ...], peer: str, token: int, until: float, what: str
    ) -> Message:
        """The next message of ``kinds`` from ``peer`` about ``token``; ``UnavailableError``
        naming ``what`` at ``until`` (time.monotonic())."""
        while True:
            self.pump()
            msg = self.take(kinds, peer, token)
            if msg is not None:
                return msg
            if time.monotonic() >= until:
                raise UnavailableError(f"{what}: no answer")
            time.sleep(_POLL_S)

    def forget(self, peer: str) -> None:
        with self._lock:
            for key in [k for k in self._boxes if k[1] == peer]:
                del self._boxes[key]
