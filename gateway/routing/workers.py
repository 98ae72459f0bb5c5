"""What the gateway's router knows of each worker, and where one request attempt goes.

A :class:`WorkerState` holds one worker's last Stats and the picks made since; it is *up*
while its last answer said it serves and it was heard from at most ``down_after_s`` ago:
a Stats answer, or a message on one of the streams it serves. A worker too busy to answer
Stats in time (its cores taken by a burst, say) but still streaming tokens is alive, and
marking it down would strand the requests that a failure elsewhere moves to it; one that
died or hung stops streaming as well.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from protos.baton.v1 import worker_pb2


class WorkerKind(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


# The roles a worker listed under each kind may report (UNSPECIFIED: not told, accepted).
ACCEPTED_ROLES = {
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

NOT_POLLED = "not polled yet"


def host_of(address: str) -> str:
    """The host part of ``host:port``."""
    return address.rpartition(":")[0]


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
    down_after_s: float = 3.0  # how long without a serving answer before it is down
    serving: bool = False  # its last answer said it serves (Stats answered, right role)
    incarnation_id: str = ""
    total_kv_blocks: int = 0
    free_kv_blocks: int = 0
    load: int = 0  # running + waiting + waiting for KV
    queued_prompt_tokens: int = 0
    picks_since_poll: int = 0
    blocks_since_poll: int = 0  # prompt blocks of those picks (decode: they take them)
    prompt_tokens_since_poll: int = 0
    last_error: str = NOT_POLLED
    last_seen: float = 0.0  # time.monotonic() of the last serving answer
    last_streamed: float = 0.0  # time.monotonic() of the last message of a stream it serves
    in_flight: int = 0  # streams routed here that have not ended
    ended_since_poll: int = 0  # of those, the ones that ended since the last answer
    # max_num_seqs + max_queued_requests as the worker reports them; 0: not reported.
    capacity: int = 0
    max_num_seqs: int = 0  # seats: requests it runs at once; 0: not reported
    waiting: int = 0  # requests it queues without seats or blocks (its last report)
    block_size: int = 0  # tokens per KV block; 0: not reported
    # Workers on one host that lend each other idle cores share a group (Stats field 16).
    core_group: str = ""
    left: bool = False  # no longer in its fleet's answer: forgotten once in_flight is 0
    # CPU: row class -> kernel route the worker runs its linear layers on (Stats field 15).
    cpu_kernel_routes: dict[str, str] = field(default_factory=dict)

    @property
    def up(self) -> bool:
        """Routable: it said it serves, and was heard from (an answer or a streamed
        message) not longer than ``down_after_s`` ago."""
        heard = max(self.last_seen, self.last_streamed)
        return self.serving and not self.left and time.monotonic() - heard <= self.down_after_s

    @property
    def occupancy(self) -> int:
        """Requests the worker holds now, as best this gateway knows: its last report,
        plus this gateway's picks since and less this gateway's streams that ended since,
        and never fewer than this gateway's own streams there."""
        estimate = self.load + self.picks_since_poll - self.ended_since_poll
        return max(self.in_flight, estimate)

    @property
    def full(self) -> bool:
        """Every seat and queue place the worker reported is taken: a request sent there
        now would only be refused (decode answers RESOURCE_EXHAUSTED once its FIFO is
        full), so the gateway refuses it itself, without the round trip."""
        return self.capacity > 0 and self.occupancy >= self.capacity

    def prompt_blocks(self, prompt_tokens: int) -> int:
        """KV blocks a prompt of ``prompt_tokens`` takes here (0: block size unknown)."""
        return -(-max(1, prompt_tokens) // self.block_size) if self.block_size else 0

    def seats_now(self, prompt_tokens: int) -> bool:
        """A request sent here now would start at once, as far as this gateway knows: a
        free seat, nothing queued ahead of it, and free blocks for its prompt beside the
        prompts picked here since the last report."""
        if not self.max_num_seqs or not self.block_size:
            return False
        free = self.free_kv_blocks - self.blocks_since_poll
        return (
            self.occupancy < self.max_num_seqs
            and not self.waiting
            and free >= self.prompt_blocks(prompt_tokens)
        )

    def decode_score(self) -> float:
        """Higher is better: free blocks per unit of (reported + recently added) load."""
        return self.free_kv_blocks / (1 + self.load + self.picks_since_poll)

    def prefill_score(self) -> int:
        """Lower is better: prompt tokens waiting to be computed."""
        return self.queued_prompt_tokens + self.prompt_tokens_since_poll

    def update(self, stats: worker_pb2.WorkerStats) -> None:
        """Take a serving answer: its load, and now as the last time it was seen."""
        self.incarnation_id = stats.incarnation_id
        self.total_kv_blocks = stats.total_kv_blocks
        self.free_kv_blocks = stats.free_kv_blocks
        self.load = stats.num_running + stats.num_waiting + stats.num_waiting_for_kv
        self.queued_prompt_tokens = stats.queued_prompt_tokens
        self.cpu_kernel_routes = dict(stats.cpu_kernel_routes)
        self.picks_since_poll = 0
        self.blocks_since_poll = 0
        self.prompt_tokens_since_poll = 0
        self.ended_since_poll = 0
        self.max_num_seqs = stats.max_num_seqs
        # Not those waiting for their KV: they hold their seats and blocks already.
        self.waiting = stats.num_waiting
        self.block_size = stats.kv_layout.block_size
        self.core_group = stats.core_group
        if stats.max_num_seqs and stats.max_queued_requests:
            self.capacity = stats.max_num_seqs + stats.max_queued_requests
        else:
            self.capacity = 0
        self.serving = True
        self.last_error = ""
        self.last_seen = time.monotonic()
