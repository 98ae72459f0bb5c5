"""Which workers a request goes to: the decode and prefill fleets, their load, their health.

A background task polls every worker's ``Stats`` (each call with its own deadline). A
worker is *up* once it has answered and *down* after a failed poll or a failed request
(UNAVAILABLE, DEADLINE_EXCEEDED or any other error: a worker that cannot report its load
is not routed to); it comes back by answering again. Picks use the latest stats plus the
picks made since, so a burst between two polls spreads out:

- decode: the most free KV blocks per unit of load (running + waiting + waiting for KV);
- prefill: the fewest queued prompt tokens.

With no prefill addresses the gateway runs in single-process mode: decode workers run
prompts themselves and ``Route.prefill`` is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from engine.errors import UnavailableError
from protos.baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.channels import ChannelCache

logger = logging.getLogger(__name__)


class WorkerKind(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


# The roles a worker listed under each kind may report (UNSPECIFIED: not told, accepted).
_ACCEPTED_ROLES = {
    WorkerKind.DECODE: {
        worker_pb2.WORKER_ROLE_UNSPECIFIED,
        worker_pb2.WORKER_ROLE_DECODE,
        worker_pb2.WORKER_ROLE_BOTH,
    },
    WorkerKind.PREFILL: {
        worker_pb2.WORKER_ROLE_UNSPECIFIED,
        worker_pb2.WORKER_ROLE_PREFILL,
        worker_pb2.WORKER_ROLE_BOTH,
    },
}


_NOT_POLLED = "not polled yet"


@dataclass(frozen=True, slots=True)
class Route:
    """Where one attempt of a request goes."""

    decode: str  # host:port
    prefill: str  # host:port; "" in single-process mode


@dataclass(slots=True)
class WorkerState:
    """What the router knows of one worker, from its last Stats and the picks since."""

    address: str
    kind: WorkerKind
    up: bool = False
    incarnation_id: str = ""
    total_kv_blocks: int = 0
    free_kv_blocks: int = 0
    load: int = 0  # running + waiting + waiting for KV
    queued_prompt_tokens: int = 0
    picks_since_poll: int = 0
    prompt_tokens_since_poll: int = 0
    last_error: str = _NOT_POLLED
    last_seen: float = 0.0  # time.monotonic() of the last answer

    def decode_score(self) -> float:
        """Higher is better: free blocks per unit of (reported + recently added) load."""
        return self.free_kv_blocks / (1 + self.load + self.picks_since_poll)

    def prefill_score(self) -> int:
        """Lower is better: prompt tokens waiting to be computed."""
        return self.queued_prompt_tokens + self.prompt_tokens_since_poll

    def update(self, stats: worker_pb2.WorkerStats) -> None:
        self.incarnation_id = stats.incarnation_id
        self.total_kv_blocks = stats.total_kv_blocks
        self.free_kv_blocks = stats.free_kv_blocks
        self.load = stats.num_running + stats.num_waiting + stats.num_waiting_for_kv
        self.queued_prompt_tokens = stats.queued_prompt_tokens
        self.picks_since_poll = 0
        self.prompt_tokens_since_poll = 0
        self.last_seen = time.monotonic()


class Router:
    """Worker lists, health and picks. ``start`` once, ``close`` once (twice is harmless).

    Owned by one event loop; ``pick`` never blocks.
    """

    def __init__(
        self,
        decode: Sequence[str],
        prefill: Sequence[str],
        channels: ChannelCache,
        *,
        poll_interval_s: float = 0.25,
        stats_timeout_s: float = 1.0,
    ) -> None:
        if not decode:
            raise ValueError("decode must list at least one worker address")
        for kind, addresses in (("decode", decode), ("prefill", prefill)):
            for address in addresses:
                if ":" not in address:
                    raise ValueError(f"{kind} address must be 'host:port', got {address!r}")
            if len(set(addresses)) != len(addresses):
                raise ValueError(f"{kind} lists an address twice: {list(addresses)}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        if stats_timeout_s <= 0:
            raise ValueError(f"stats_timeout_s must be > 0, got {stats_timeout_s}")
        self._decode = [WorkerState(a, WorkerKind.DECODE) for a in decode]
        self._prefill = [WorkerState(a, WorkerKind.PREFILL) for a in prefill]
        self._channels = channels
        self._poll_interval_s = poll_interval_s
        self._stats_timeout_s = stats_timeout_s
        self._decode_up = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def single_process(self) -> bool:
        """True when no prefill workers are configured: decode runs prompts itself."""
        return not self._prefill

    @property
    def workers(self) -> tuple[WorkerState, ...]:
        return (*self._decode, *self._prefill)

    def start(self) -> None:
        """Begin polling: one task per worker, so a worker that hangs delays no other."""
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._poll_forever(w), name=f"poll-{w.kind.value}-{w.address}")
                for w in self.workers
            ]

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait_ready(self) -> None:
        """Return once any decode worker has answered Stats (starts polling if needed)."""
        self.start()
        await self._decode_up.wait()

    def pick(
        self,
        num_prompt_tokens: int,
        *,
        avoid_prefill: Collection[str] = (),
        avoid_decode: Collection[str] = (),
    ) -> Route:
        """The best decode worker and the best prefill worker, preferring workers not in
        ``avoid_decode`` / ``avoid_prefill`` (ones a failed attempt used). Raises
        UnavailableError when no worker of a needed kind is up."""
        decode = self._best_decode(avoid_decode)
        prefill = ""
        if self._prefill:
            chosen = self._best_prefill(avoid_prefill)
            chosen.prompt_tokens_since_poll += num_prompt_tokens
            prefill = chosen.address
        decode.picks_since_poll += 1
        return Route(decode=decode.address, prefill=prefill)

    async def probe(self, address: str, kind: WorkerKind = WorkerKind.DECODE) -> bool:
        """Ask one worker for Stats now (after a failed request); True when it is up."""
        for worker in self._workers_of(kind):
            if worker.address == address:
                await self._poll(worker)
                return worker.up
        raise ValueError(f"{kind.value} worker {address!r} is not configured")

    def _workers_of(self, kind: WorkerKind) -> list[WorkerState]:
        return self._decode if kind is WorkerKind.DECODE else self._prefill

    def _best_decode(self, avoid: Collection[str] = ()) -> WorkerState:
        up = [(i, w) for i, w in enumerate(self._decode) if w.up]
        if not up:
            raise UnavailableError(
                f"no decode worker is up ({len(self._decode)} configured); retry later"
            )
        fresh = [(i, w) for i, w in up if w.address not in avoid]
        return max(fresh or up, key=lambda iw: (iw[1].decode_score(), -iw[0]))[1]

    def _best_prefill(self, avoid: Collection[str]) -> WorkerState:
        up = [(i, w) for i, w in enumerate(self._prefill) if w.up]
        if not up:
            raise UnavailableError(
                f"no prefill worker is up ({len(self._prefill)} configured); retry later"
            )
        fresh = [(i, w) for i, w in up if w.address not in avoid]
        return min(fresh or up, key=lambda iw: (iw[1].prefill_score(), iw[0]))[1]

    async def _poll_forever(self, worker: WorkerState) -> None:
        while True:
            began = time.monotonic()
            await self._poll(worker)
            elapsed = time.monotonic() - began
            await asyncio.sleep(max(0.0, self._poll_interval_s - elapsed))

    async def _poll(self, worker: WorkerState) -> None:
        channel = self._channels.get(worker.address)
        stub: worker_pb2_grpc.DecodeWorkerStub | worker_pb2_grpc.PrefillWorkerStub
        if worker.kind is WorkerKind.DECODE:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        else:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        try:
            stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=self._stats_timeout_s)
        except grpc.aio.AioRpcError as err:
            self._mark_down(worker, f"Stats failed with {err.code().name}: {err.details()}")
            return
        if stats.role not in _ACCEPTED_ROLES[worker.kind]:
            role = worker_pb2.WorkerRole.Name(stats.role)
            self._mark_down(worker, f"it reports role {role}, not usable as {worker.kind.value}")
            return
        self._mark_up(worker, stats)

    def _mark_up(self, worker: WorkerState, stats: worker_pb2.WorkerStats) -> None:
        restarted = worker.incarnation_id and worker.incarnation_id != stats.incarnation_id
        if not worker.up or restarted:
            logger.info(
                "%s worker %s is up (incarnation %s%s)",
                worker.kind.value,
                worker.address,
                stats.incarnation_id or "?",
                ", restarted" if restarted else "",
            )
        worker.update(stats)
        worker.up = True
        worker.last_error = ""
        if worker.kind is WorkerKind.DECODE:
            self._decode_up.set()

    def _mark_down(self, worker: WorkerState, reason: str) -> None:
        # Warn on the way down (and on the first poll); repeats of a known outage are noise.
        first = worker.last_seen == 0.0 and worker.last_error == _NOT_POLLED
        log = logger.warning if worker.up or first else logger.debug
        log("%s worker %s is down: %s", worker.kind.value, worker.address, reason)
        worker.up = False
        worker.last_error = reason
