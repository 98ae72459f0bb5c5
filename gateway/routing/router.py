"""Which workers a request goes to: the decode and prefill fleets, their load, their health.

Fleets are gRPC-style targets (``gateway.routing.discovery``): fixed ``HOST:PORT`` addresses, or
``dns:///NAME:PORT`` names that are looked up again every ``resolve_interval_s`` and soon
after a failure. A worker that appears in an answer is polled, and routed to once it
answers ``Stats`` (which a server admits only while SERVING). A worker that leaves the
answer is no longer routed to and is forgotten; its channel is closed only once the
streams that were using it have ended, so leaving never disturbs a stream in flight.

Every worker's ``Stats`` is polled on its own task (each call with its own deadline). A
worker is *up* while its last answer said it serves and that answer is at most
``down_after_s`` old: one missed poll (a busy engine, a dropped connection) does not take
it out of rotation, silence does. A worker whose health says NOT_SERVING (it is draining
on SIGTERM, or still starting), or at whose address nothing accepts a connection (its
process died), is out at once. Picks use the latest stats plus the picks
made since, so a burst between two polls spreads out:

- decode: the most free KV blocks per unit of load (running + waiting + waiting for KV),
  among the workers that are not full: a worker reports its bounds (``max_num_seqs``
  seats, ``max_queued_requests`` queue places), and when the requests it holds (its last
  report, plus this gateway's picks since, less this gateway's streams that ended since,
  never fewer than this gateway's own streams there) fill both, a request is not sent
  there. When every decode worker that is up is full the request is refused at once with
  RESOURCE_EXHAUSTED, before any round trip (and, through ``check_room``, before it is
  tokenized). Workers on one host that lend each other idle cores (one core group) count
  as one worker, and fill one member while it has a seat, blocks and no queue (packed:
  one batch on the lent cores, not several that each read the weights);
- prefill: the fewest queued prompt tokens.

A request that finds no worker of a kind it needs up waits up to ``wait_for_worker_s``
(never past its deadline) for one to answer, then fails with UNAVAILABLE saying for how
long none has answered. With no prefill targets the gateway runs in single-process mode:
decode workers run prompts themselves and ``Route.prefill`` is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.errors import ResourceExhaustedError, UnavailableError
from gateway.routing.discovery import Fleet, Resolver, system_resolver
from gateway.routing.kv_feed import KVFeed
from gateway.routing.kv_index import PromptHashes
from gateway.routing.workers import (
    ACCEPTED_ROLES,
    NOT_POLLED,
    Route,
    WorkerKind,
    WorkerState,
    host_of,
)
from protos.baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.channels import ChannelCache

logger = logging.getLogger(__name__)

# After a failure asks for a fresh lookup, the next one waits at least this long after
# the previous one, so a burst of failures is one lookup, not a storm.
_MIN_RESOLVE_GAP_S = 0.5


class Router:
    """Fleets, health and picks. ``start`` once, ``close`` once (twice is harmless).

    Owned by one event loop; ``pick`` never blocks, ``route`` waits for a worker.
    """

    def __init__(
        self,
        decode: Sequence[str],
        prefill: Sequence[str],
        channels: ChannelCache,
        *,
        resolver: Resolver = system_resolver,
        poll_interval_s: float = 0.25,
        stats_timeout_s: float = 1.0,
        down_after_s: float = 3.0,
        resolve_interval_s: float = 5.0,
        wait_for_worker_s: float = 3.0,
        same_host_prefill: bool = False,
        kv_feed: KVFeed | None = None,
        cache_weight: float = 2.0,
        local_prefill_tokens: int = 0,
        local_cached_fraction: float = 1.0,
    ) -> None:
        if not decode:
            raise ValueError("decode must list at least one worker target")
        for name, value in (
            ("poll_interval_s", poll_interval_s),
            ("stats_timeout_s", stats_timeout_s),
            ("down_after_s", down_after_s),
            ("resolve_interval_s", resolve_interval_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if wait_for_worker_s < 0:
            raise ValueError(f"wait_for_worker_s must be >= 0, got {wait_for_worker_s}")
        if not cache_weight >= 0:
            raise ValueError(f"cache_weight must be >= 0, got {cache_weight}")
        # Cache-aware routing (None: by load only): the workers' KV events, and how much a
        # cached prompt token counts against a queued one.
        self._kv_feed = kv_feed
        self._cache_weight = cache_weight
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
        if not 0.0 < local_cached_fraction <= 1.0:
            raise ValueError(
                f"local_cached_fraction must be in (0, 1], got {local_cached_fraction}"
            )
        # Conditional disaggregation (kv routing only): a prompt whose uncached part on a
        # decode worker is at most local_prefill_tokens, or of which that worker holds at
        # least local_cached_fraction, is prefilled there instead of on a prefill worker.
        self._local_prefill_tokens = local_prefill_tokens
        self._local_cached_fraction = local_cached_fraction
        self.local_prefills = 0
        self.remote_prefills = 0
        # Prompt tokens routed, and of those the ones the chosen worker held (kv routing).
        self.routed_prompt_tokens = 0
        self.routed_cached_tokens = 0
        self._fleets = {
            WorkerKind.DECODE: Fleet("decode", decode, resolver),
            WorkerKind.PREFILL: Fleet("prefill", prefill, resolver),
        }
        self._channels = channels
        self._poll_interval_s = poll_interval_s
        self._stats_timeout_s = stats_timeout_s
        self._down_after_s = down_after_s
        self._resolve_interval_s = resolve_interval_s
        self._wait_for_worker_s = wait_for_worker_s
        self._same_host_prefill = same_host_prefill
        self._workers: dict[WorkerKind, dict[str, WorkerState]] = {k: {} for k in WorkerKind}
        self._polls: dict[tuple[WorkerKind, str], asyncio.Task[None]] = {}
        self._resolve_task: asyncio.Task[None] | None = None
        self._resolve_soon = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) whenever a worker comes up
        self._decode_up = asyncio.Event()
        self._started_at = time.monotonic()
        # When a worker of each kind last answered as serving (survives forgetting it).
        self._last_answer: dict[WorkerKind, float] = {}
        self._started = False
        for kind, fleet in self._fleets.items():
            self._sync(kind, fleet.addresses())

    @property
    def single_process(self) -> bool:
        """True when no prefill targets are configured: decode runs prompts itself."""
        return not self._fleets[WorkerKind.PREFILL].targets

    @property
    def workers(self) -> tuple[WorkerState, ...]:
        """Every known worker, decode first, each fleet in discovery order."""
        return (
            *self._workers[WorkerKind.DECODE].values(),
            *self._workers[WorkerKind.PREFILL].values(),
        )

    def start(self) -> None:
        """Begin polling (one task per worker, so one that hangs delays no other) and, when
        a fleet is named by DNS, resolving."""
        if self._started:
            return
        self._started = True
        self._started_at = time.monotonic()
        for worker in self.workers:
            self._start_poll(worker)
        if any(f.dynamic for f in self._fleets.values()):
            self._resolve_task = asyncio.create_task(self._resolve_forever(), name="resolve")

    async def close(self) -> None:
        if self._kv_feed is not None:
            await self._kv_feed.close()
        tasks = [*self._polls.values()]
        if self._resolve_task is not None:
            tasks.append(self._resolve_task)
        self._polls, self._resolve_task = {}, None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait_ready(self) -> None:
        """Return once any decode worker has answered Stats (starts polling if needed)."""
        self.start()
        await self._decode_up.wait()

    async def refresh(self) -> None:
        """Resolve every fleet now and apply the answers (also done on a timer)."""
        for kind, fleet in self._fleets.items():
            if fleet.dynamic:
                self._sync(kind, await fleet.resolve())

    # -- picking ------------------------------------------------------------------------

    def pick(
        self,
        num_prompt_tokens: int,
        *,
        avoid_prefill: Collection[str] = (),
        avoid_decode: Collection[str] = (),
        prompt: Sequence[int] | None = None,
        exclude_decode: Collection[str] = (),
    ) -> Route:
        """The best decode worker and the best prefill worker, preferring ones not in the
        ``avoid_*`` sets (ones a failed attempt used) while another is up, and never one in
        ``exclude_decode`` (decode workers a moving request left behind: they may still
        look up for ``down_after_s`` after they died). With
        ``same_host_prefill`` both are on one host. With ``prompt`` (its token ids) and
        cache-aware routing, the worker that runs the prompt is chosen by the work it
        would have ahead (:meth:`_prompt_work`). Raises UnavailableError when no worker
        (pair) of a needed kind is up."""
        hashes = PromptHashes(prompt) if prompt is not None and self._kv_feed is not None else None
        if self._same_host_prefill and not self.single_process:
            hosts = {host_of(w.address) for w in self._workers[WorkerKind.PREFILL].values() if w.up}
            decode = self._best(
                WorkerKind.DECODE,
                avoid_decode,
                lambda w: host_of(w.address) in hosts,
                exclude=exclude_decode,
                prompt_tokens=num_prompt_tokens,
            )
            chosen = self._best(
                WorkerKind.PREFILL,
                avoid_prefill,
                lambda w: host_of(w.address) == host_of(decode.address),
            )
            chosen.prompt_tokens_since_poll += num_prompt_tokens
            decode.picks_since_poll += 1
            decode.blocks_since_poll += decode.prompt_blocks(num_prompt_tokens)
            return Route(decode=decode.address, prefill=chosen.address)
        prefill = ""
        if self.single_process:
            decode = self._best(
                WorkerKind.DECODE,
                avoid_decode,
                prompt=hashes,
                exclude=exclude_decode,
                prompt_tokens=num_prompt_tokens,
            )
            self._uncached(decode, num_prompt_tokens, hashes)
        elif (
            hashes is not None
            and self._local_prefill_tokens
            and (local := self._local([*avoid_decode, *exclude_decode], hashes)) is not None
        ):
            decode = local
            decode.prompt_tokens_since_poll += self._uncached(decode, num_prompt_tokens, hashes)
            self.local_prefills += 1
        else:
            decode = self._best(
                WorkerKind.DECODE,
                avoid_decode,
                exclude=exclude_decode,
                holding=hashes,
                prompt_tokens=num_prompt_tokens,
            )
            chosen = self._best(WorkerKind.PREFILL, avoid_prefill, prompt=hashes)
            chosen.prompt_tokens_since_poll += self._uncached(chosen, num_prompt_tokens, hashes)
            if hashes is not None and self._kv_feed is not None:
                # Decode caches the prompt's blocks once its KV has arrived.
                self._kv_feed.index.expect(decode.address, hashes)
            prefill = chosen.address
            self.remote_prefills += 1
        decode.picks_since_poll += 1
        decode.blocks_since_poll += decode.prompt_blocks(num_prompt_tokens)
        return Route(decode=decode.address, prefill=prefill)

    def _local(self, avoid: Collection[str], prompt: PromptHashes) -> WorkerState | None:
        """The decode worker to prefill ``prompt`` on itself, if one qualifies: up, not
        full, not avoided, holding all but ``local_prefill_tokens`` of the prompt or at
        least ``local_cached_fraction`` of it, and with no prompt tokens queued (its
        report plus this gateway's local picks since) or few enough that they and this
        prompt's uncached ones stay within ``local_prefill_tokens``; the one holding
        most, then the best by free blocks and load (by :func:`_packed` where none holds
        any of it)."""
        assert self._kv_feed is not None
        index = self._kv_feed.index
        n = len(prompt.token_ids)
        best: tuple[int, float, WorkerState] | None = None
        fit: list[tuple[int, WorkerState]] = []
        for i, w in enumerate(self._workers[WorkerKind.DECODE].values()):
            if not w.up or w.full or w.address in avoid:
                continue
            # Only what it holds now: a prefix still on its way here would be computed
            # again by the local prefill.
            cached = min(n, index.cached_tokens(w.address, prompt, expected=False))
            pending = w.queued_prompt_tokens + w.prompt_tokens_since_poll
            if pending and pending + n - cached > self._local_prefill_tokens:
                continue  # busy with prompts already: this one goes to a prefill worker
            if n - cached > self._local_prefill_tokens and (
                cached < self._local_cached_fraction * n or not cached
            ):
                continue
            fit.append((i, w))
            key = (cached, w.decode_score(), w)
            if best is None or key[:2] > best[:2]:
                best = key
        if best is None:
            return None
        return best[2] if best[0] else _packed(fit, n)

    def _uncached(self, worker: WorkerState, n: int, prompt: PromptHashes | None) -> int:
        """Prompt tokens ``worker``, chosen to compute the prompt, would compute (all of
        them when its cache is unknown); its blocks are expected there from now on."""
        if prompt is None or self._kv_feed is None:
            return n
        cached = min(n, self._kv_feed.index.cached_tokens(worker.address, prompt))
        self._kv_feed.index.expect(worker.address, prompt)
        self.routed_prompt_tokens += n
        self.routed_cached_tokens += cached
        return max(1, n - cached)

    def _prompt_work(self, worker: WorkerState, prompt: PromptHashes) -> float:
        """The worker's cost for this prompt: what it has queued (its report plus this
        gateway's picks since), plus this prompt's tokens less ``cache_weight`` x the
        ones it holds or was just sent (0: load only). At 1 this is the prompt tokens it
        would compute before this prompt's last one. Above 1 a cached token also stands
        for the compute the fleet saves: a worker holding a prefix may have up to
        (weight - 1) x that prefix more queued than one that does not, so a burst sharing
        a new system prompt lines up behind the one computing it instead of computing it
        again on every worker."""
        assert self._kv_feed is not None
        cached = self._kv_feed.index.cached_tokens(worker.address, prompt)
        own = len(prompt.token_ids) - self._cache_weight * cached
        return worker.queued_prompt_tokens + worker.prompt_tokens_since_poll + own

    def check_room(self, admitted: int) -> None:
        """Raise ResourceExhaustedError when every decode worker that is up is full (see
        :attr:`WorkerState.full`), or when ``admitted`` (this gateway's requests in flight,
        those still being tokenized included) already fill every seat and queue place the
        up decode workers reported. Cheap: a front end calls it before any other work, so
        a burst's excess is refused on arrival rather than behind the tokenizer queue."""
        up = [(i, w) for i, w in enumerate(self._workers[WorkerKind.DECODE].values()) if w.up]
        if not up:
            return  # route() waits for a worker, then says none is up
        if all(w.full for _, w in up):
            self._all_full(up)
        if all(w.capacity for _, w in up) and admitted >= sum(w.capacity for _, w in up):
            self._all_full(up, admitted)

    async def route(
        self,
        num_prompt_tokens: int,
        *,
        avoid_prefill: Collection[str] = (),
        avoid_decode: Collection[str] = (),
        timeout: float | None = None,
        prompt: Sequence[int] | None = None,
        exclude_decode: Collection[str] = (),
    ) -> Route:
        """:meth:`pick`, waiting up to ``wait_for_worker_s`` (and at most ``timeout``) for
        a worker of each needed kind to be up; then UnavailableError saying how long none
        has answered."""
        loop = asyncio.get_running_loop()
        limit = (
            self._wait_for_worker_s if timeout is None else min(self._wait_for_worker_s, timeout)
        )
        give_up = loop.time() + max(0.0, limit)
        while True:
            changed = self._changed
            try:
                return self.pick(
                    num_prompt_tokens,
                    avoid_prefill=avoid_prefill,
                    avoid_decode=avoid_decode,
                    prompt=prompt,
                    exclude_decode=exclude_decode,
                )
            except UnavailableError:
                left = give_up - loop.time()
                if left <= 0:
                    raise
                self._resolve_soon.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)

    @contextlib.contextmanager
    def using(self, route: Route) -> Iterator[None]:
        """Count a stream on the workers of ``route`` while it runs, so a worker that left
        its fleet keeps its channel until its last stream has ended."""
        held = [
            w
            for kind, address in (
                (WorkerKind.DECODE, route.decode),
                (WorkerKind.PREFILL, route.prefill),
            )
            if address and (w := self._workers[kind].get(address)) is not None
        ]
        for worker in held:
            worker.in_flight += 1
        try:
            yield
        finally:
            for worker in held:
                worker.in_flight -= 1
                worker.ended_since_poll += 1
                if worker.left and worker.in_flight == 0:
                    self._forget(worker)

    def heard_from(self, address: str, kind: WorkerKind = WorkerKind.DECODE) -> None:
        """A stream on the worker at ``address`` delivered a message: it is alive, even
        while its Stats answers are late (see ``WorkerState.up``)."""
        worker = self._workers[kind].get(address)
        if worker is not None:
            worker.last_streamed = time.monotonic()

    async def probe(self, address: str, kind: WorkerKind = WorkerKind.DECODE) -> bool:
        """Ask one worker for Stats now (after a failed request), and have the fleets looked
        up again soon. True when it answered as serving."""
        self._resolve_soon.set()
        worker = self._workers[kind].get(address)
        if worker is None:
            raise ValueError(f"{kind.value} worker {address!r} is not known")
        return await self._poll(worker)

    def _best(
        self,
        kind: WorkerKind,
        avoid: Collection[str],
        allowed: Callable[[WorkerState], bool] = lambda w: True,
        prompt: PromptHashes | None = None,
        exclude: Collection[str] = (),
        holding: PromptHashes | None = None,
        prompt_tokens: int = 0,
    ) -> WorkerState:
        """The worker of ``kind`` to use: by the work ahead of ``prompt`` where it is
        cached (:meth:`_prompt_work`), else by load. ``holding`` (decode, remote prefill):
        a prompt whose KV a prefill worker sends, less the leading blocks the decode worker
        holds, so one holding them scores up to twice its load score (by the fraction
        held, times ``cache_weight`` where that is below 1): fewer bytes moved, fewer
        blocks taken, and the conversation stays where its next turn can be prefilled
        locally. Where no decode worker holds any of it, decode workers of one core group
        count as one (:func:`_packed`)."""
        workers = list(self._workers[kind].values())
        up = [(i, w) for i, w in enumerate(workers) if w.up]
        if not up:
            raise UnavailableError(self._none_up(kind, workers))
        if exclude:
            up = [(i, w) for i, w in up if w.address not in exclude]
            if not up:
                raise UnavailableError(
                    f"no {kind.value} worker is up but the one(s) this request already "
                    f"failed on ({', '.join(sorted(exclude))}); retry later"
                )
        up = [(i, w) for i, w in up if allowed(w)]
        if not up:
            raise UnavailableError(
                f"no {kind.value} worker is up on the same host as an up "
                f"{'prefill' if kind is WorkerKind.DECODE else 'decode'} worker "
                "(same-host pairing of co-located workers); retry later"
            )
        if kind is WorkerKind.DECODE:
            up = [(i, w) for i, w in up if not w.full] or self._all_full(up)
        fresh = [(i, w) for i, w in up if w.address not in avoid] or up
        if prompt is not None and self._cached_anywhere(fresh, prompt):
            # Where the prompt's prefix is cached, unless the work queued there outweighs
            # it; ties go to the less loaded worker.
            return min(
                fresh,
                key=lambda iw: (
                    self._prompt_work(iw[1], prompt),
                    -iw[1].decode_score() if kind is WorkerKind.DECODE else 0.0,
                    iw[1].prefill_score(),
                    iw[0],
                ),
            )[1]
        if kind is WorkerKind.DECODE:
            held = self._held_fraction(holding)
            if not any(held(w) > 1.0 for _, w in fresh):
                return _packed(fresh, prompt_tokens)
            return max(fresh, key=lambda iw: (iw[1].decode_score() * held(iw[1]), -iw[0]))[1]
        return min(fresh, key=lambda iw: (iw[1].prefill_score(), iw[0]))[1]

    def _held_fraction(self, prompt: PromptHashes | None) -> Callable[[WorkerState], float]:
        """1 + the share of ``prompt`` a worker holds, scaled down by a ``cache_weight``
        below 1 (1 when unknown, and at weight 0)."""
        if prompt is None or self._kv_feed is None or not prompt.token_ids:
            return lambda w: 1.0
        index, n = self._kv_feed.index, len(prompt.token_ids)
        weight = min(1.0, self._cache_weight)
        return lambda w: 1.0 + weight * min(n, index.cached_tokens(w.address, prompt)) / n

    def _cached_anywhere(
        self, workers: list[tuple[int, WorkerState]], prompt: PromptHashes
    ) -> bool:
        assert self._kv_feed is not None
        index = self._kv_feed.index
        return self._cache_weight > 0 and any(
            index.cached_tokens(w.address, prompt) for _, w in workers
        )

    @staticmethod
    def _all_full(
        up: list[tuple[int, WorkerState]], held: int | None = None
    ) -> list[tuple[int, WorkerState]]:
        """Every decode worker that is up has each seat and queue place taken: refuse at
        once, rather than send the request to be refused after a round trip."""
        if held is None:
            held = sum(w.occupancy for _, w in up)
        capacity = sum(w.capacity for _, w in up)
        raise ResourceExhaustedError(
            f"every decode worker is at capacity ({held} requests held against "
            f"{capacity} = max_num_seqs + max_queued_requests over {len(up)} worker(s)); "
            "retry later"
        )

    def _none_up(self, kind: WorkerKind, workers: list[WorkerState]) -> str:
        targets = ", ".join(t.text for t in self._fleets[kind].targets)
        if not workers:
            return f"no {kind.value} worker is up: {targets} resolve(s) to no address; retry later"
        now = time.monotonic()
        last = self._last_answer.get(kind)
        if last is None:
            silence = (
                f"none has answered since the gateway started {now - self._started_at:.1f}s ago"
            )
        else:
            silence = f"none has answered as serving for {now - last:.1f}s"
        errors = "; ".join(f"{w.address}: {w.last_error or 'silent'}" for w in workers[:4])
        return (
            f"no {kind.value} worker is up ({len(workers)} known from {targets}): {silence} "
            f"(down after {self._down_after_s:g}s without an answer) [{errors}]; retry later"
        )

    # -- the fleets ---------------------------------------------------------------------

    async def _resolve_forever(self) -> None:
        last = 0.0
        while True:
            gap = time.monotonic() - last
            if gap < _MIN_RESOLVE_GAP_S:
                await asyncio.sleep(_MIN_RESOLVE_GAP_S - gap)
            self._resolve_soon.clear()
            last = time.monotonic()
            try:
                await self.refresh()
            except Exception:  # a resolver bug must not stop discovery for good
                logger.exception("resolving the worker fleets failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resolve_soon.wait(), self._resolve_interval_s)

    def _sync(self, kind: WorkerKind, addresses: Sequence[str]) -> None:
        """Make the known workers of ``kind`` the ones in ``addresses``."""
        known = self._workers[kind]
        for address in addresses:
            worker = known.get(address)
            if worker is None:
                worker = WorkerState(address, kind, down_after_s=self._down_after_s)
                known[address] = worker
                if self._started:
                    logger.info("%s worker %s appeared; polling it", kind.value, address)
                    self._start_poll(worker)
            elif worker.left:  # back before its last stream ended: keep it
                worker.left = False
        gone = set(known) - set(addresses)
        for address in gone:
            worker = known[address]
            if not worker.left:
                logger.info(
                    "%s worker %s left its fleet; no new requests go to it (%d in flight)",
                    kind.value,
                    address,
                    worker.in_flight,
                )
                worker.left = True
            if worker.in_flight == 0:
                self._forget(worker)

    def _forget(self, worker: WorkerState) -> None:
        known = self._workers[worker.kind]
        if known.get(worker.address) is not worker:
            return
        del known[worker.address]
        poll = self._polls.pop((worker.kind, worker.address), None)
        if poll is not None:
            poll.cancel()
        if self._kv_feed is not None and self._runs_prompts(worker.kind):
            self._kv_feed.untrack(worker.address)
        if not any(worker.address in ws for ws in self._workers.values()):
            # Out of the cache at once: a worker that reappears gets a fresh channel.
            self._channels.discard(worker.address)
        logger.info("%s worker %s forgotten", worker.kind.value, worker.address)

    # -- polling ------------------------------------------------------------------------

    def _start_poll(self, worker: WorkerState) -> None:
        key = (worker.kind, worker.address)
        if self._kv_feed is not None and self._runs_prompts(worker.kind):
            self._kv_feed.track(worker.address, worker.kind)
        if key not in self._polls:
            self._polls[key] = asyncio.create_task(
                self._poll_forever(worker), name=f"poll-{worker.kind.value}-{worker.address}"
            )

    def _runs_prompts(self, kind: WorkerKind) -> bool:
        """Whether the cache of workers of ``kind`` decides routing: decode workers' in
        single-process mode and under conditional disaggregation, prefill workers'
        otherwise."""
        if kind is WorkerKind.DECODE:
            return self.single_process or self._local_prefill_tokens > 0
        return not self.single_process

    async def _poll_forever(self, worker: WorkerState) -> None:
        while True:
            began = time.monotonic()
            await self._poll(worker)
            elapsed = time.monotonic() - began
            await asyncio.sleep(max(0.0, self._poll_interval_s - elapsed))

    async def _poll(self, worker: WorkerState) -> bool:
        """One Stats call; True when the worker answered as serving."""
        was_up = worker.up
        channel = self._channels.get(worker.address)
        stub: worker_pb2_grpc.DecodeWorkerStub | worker_pb2_grpc.PrefillWorkerStub
        if worker.kind is WorkerKind.DECODE:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        else:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        try:
            stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=self._stats_timeout_s)
        except grpc.aio.AioRpcError as err:
            reason = f"Stats failed with {err.code().name}: {err.details()}"
            if err.code() is grpc.StatusCode.UNAVAILABLE:
                if await self._not_serving(channel):
                    worker.serving = False  # draining or starting: out of rotation at once
                    reason = f"health is NOT_SERVING ({err.details()})"
                elif _refused(channel):
                    # Nothing accepts connections there (its process died): out at once,
                    # not after down_after_s, which is for a busy or briefly cut-off worker.
                    worker.serving = False
                    reason = f"cannot connect ({err.details()})"
            self._missed(worker, reason, was_up)
            return False
        if stats.role not in ACCEPTED_ROLES[worker.kind]:
            role = worker_pb2.WorkerRole.Name(stats.role)
            worker.serving = False
            self._missed(
                worker, f"it reports role {role}, not usable as {worker.kind.value}", was_up
            )
            return False
        self._answered(worker, stats, was_up)
        return True

    async def _not_serving(self, channel: grpc.aio.Channel) -> bool:
        """True when the worker's grpc.health.v1 says NOT_SERVING (not: when it is silent)."""
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self._stats_timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status != health_pb2.HealthCheckResponse.SERVING

    def _answered(self, worker: WorkerState, stats: worker_pb2.WorkerStats, was_up: bool) -> None:
        restarted = worker.incarnation_id and worker.incarnation_id != stats.incarnation_id
        worker.update(stats)
        self._last_answer[worker.kind] = worker.last_seen
        if not was_up or restarted:
            logger.info(
                "%s worker %s is up (incarnation %s%s)",
                worker.kind.value,
                worker.address,
                stats.incarnation_id or "?",
                ", restarted" if restarted else "",
            )
            self._changed.set()
            self._changed = asyncio.Event()
        if worker.kind is WorkerKind.DECODE:
            self._decode_up.set()

    def _missed(self, worker: WorkerState, reason: str, was_up: bool) -> None:
        first = worker.last_error == NOT_POLLED
        worker.last_error = reason
        if was_up and not worker.up:
            logger.warning("%s worker %s is down: %s", worker.kind.value, worker.address, reason)
        elif first or was_up:
            # The first poll of a starting worker, or a miss that is tolerated for now.
            logger.info("%s worker %s: %s", worker.kind.value, worker.address, reason)
        else:
            logger.debug("%s worker %s: %s", worker.kind.value, worker.address, reason)
        if was_up:
            self._resolve_soon.set()  # it may have been replaced: look the fleet up again


def _packed(workers: list[tuple[int, WorkerState]], prompt_tokens: int) -> WorkerState:
    """The decode worker by load, where the workers of one core group (on one host,
    lending each other idle cores: ``WorkerState.core_group``) count as one: the group
    (or lone worker) with the most free blocks per unit of load, then within a group the
    busiest member a request of ``prompt_tokens`` would start on at once, the first
    listed among equals. Spread over a group, N streams are N/k-row batches on k members
    that each read every weight each step and time-share the cores; packed, they are one
    batch on the cores the idle members lend (workers_on_one_host: 0.68x the throughput
    of one decode worker with two members spread). A member with no seat, blocks or
    queue to spare passes the next request on; when none has, the best by load."""
    units: dict[str, list[tuple[int, WorkerState]]] = {}
    for i, w in workers:
        units.setdefault(w.core_group or f"\0{w.address}", []).append((i, w))

    def score(unit: list[tuple[int, WorkerState]]) -> tuple[float, int]:
        free = sum(w.free_kv_blocks for _, w in unit)
        load = sum(w.load + w.picks_since_poll for _, w in unit)
        return free / (1 + load), -unit[0][0]

    unit = max(units.values(), key=score)
    ready = [(i, w) for i, w in unit if len(unit) > 1 and w.seats_now(prompt_tokens)]
    if ready:
        return max(ready, key=lambda iw: (iw[1].occupancy, -iw[0]))[1]
    return max(unit, key=lambda iw: (iw[1].decode_score(), -iw[0]))[1]


def _refused(channel: grpc.aio.Channel) -> bool:
    """Whether the channel's last attempt to connect failed (it waits in TRANSIENT_FAILURE
    before the next): the address has no server, where a call that failed on a connected
    channel (a reset, a GOAWAY) leaves it IDLE or READY."""
    return channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.TRANSIENT_FAILURE
