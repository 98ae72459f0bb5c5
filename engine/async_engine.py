"""The asyncio face of the engine, and the engine thread behind it.

The engine thread owns the scheduler and block pool outright; asyncio code never touches
them. It talks to the thread through a command queue (add, abort, reserve, KV ready,
release) and gets outputs back through ``call_soon_threadsafe``, so the event loop never
blocks on a step. Reservations the pool cannot take at once wait in the scheduler's FIFO
and are granted by the engine thread as blocks free up (no polling). A command that
raises fails the one request it was for (its stream ends with ``InternalError`` naming
the cause); if the engine thread itself dies, every open stream ends with
``UnavailableError`` at once and ``on_death`` tells the service (which reports
NOT_SERVING).

Load is read from a snapshot the engine thread publishes after every step and command
batch (``stats``), so a caller never waits on a busy engine to learn that it is busy.

Steps overlap: while step N computes on the runner's compute thread (the thread that
also loaded the model: ``engine.compute_thread``), the engine thread schedules step N+1
and builds its input tensors (tokens that N will sample are *pending* and the runner
fills them in), queues it behind N, and only then waits for N and applies its results.
So the runner starts N+1 the moment N's samples exist, and the engine thread's work
(commands, scheduling, input preparation, updates, handing outputs to asyncio) falls
inside the forward of the step after. That is what a GPU wants. On a 2-core CPU the
forward's OpenMP threads hold both cores and the engine's work is under 2% of a W1 step
(``benchmarks/w1_profile.py``: the synchronous loop keeps a forward in flight 98% of
the time), so overlap can win at most that much there, while the engine thread's work
takes a core from the forward's team (W1 fp32: 152.1 tok/s overlapped against 163.7
synchronous, ``benchmarks/results/w1_2026-12-03_overlap.md``). Where the forward's team holds
every core the engine therefore runs the whole loop on the compute thread, one step after
another (``overlap=False``, the default there); with a GPU or spare cores it overlaps.
The busy fraction is the share of wall time with a forward in flight, measured by the
runner the same way as in the synchronous loop. With a ``timeline`` (engine.timeline)
the engine thread records its schedule / wait / update spans and the runner its
prepare / forward / sample spans.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.compute_thread import serial_torch_here
from engine.engine_core import EngineCore
from engine.errors import BatonError, InternalError, ResourceExhaustedError, UnavailableError
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.stats import EngineStats
from engine.timeline import ENGINE, OFF, TimelineRecorder

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVLease:
    """Blocks reserved on this engine for a request whose KV a prefill worker will write."""

    request_id: str
    # The blocks a prefill worker must write: the prompt's logical blocks from
    # ``first_block`` on (the ones before are this engine's cached prefix, shared).
    block_ids: list[int]
    # BlockPool.generation of those blocks when reserved: the lease's epoch on the wire,
    # checked again when the KV is declared ready.
    generation: int
    first_block: int = 0


class _Stream:
    """Per-request output channel living on the event loop."""

    __slots__ = ("queue", "done")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.done = False


@dataclass(frozen=True, slots=True)
class _Command:
    """One call to run on the engine thread, for one request (or none)."""

    name: str
    run: Callable[[], None]
    request_id: str | None = None


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        *,
        on_death: Callable[[BaseException], None] | None = None,
        overlap: bool | None = None,
        timeline: TimelineRecorder = OFF,
    ):
        """``overlap``: schedule and prepare step N+1 on the engine thread while step N
        computes. False runs the whole loop on the runner's compute thread, one step after
        another like ``EngineCore.step``, so that nothing but the forward runs while the
        forward's OpenMP threads hold every core. None (the default) picks False on a CPU
        whose every core the forward's team holds, True otherwise (a GPU, or spare cores).
        ``on_death`` is called on the event loop, once, if the engine thread dies."""
        self.core = core
        if overlap is None:
            runner = core.runner
            overlap = runner.device.type != "cpu" or not runner.compute.holds_every_core()
        self.overlap = overlap
        self.timeline = timeline
        core.runner.timeline = timeline  # the runner's spans go on the same timeline
        self.on_death = on_death
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._started_at = time.monotonic()
        self._busy_at_start = 0.0
        # Replaced (never mutated) by the engine thread; read from any thread.
        self._snapshot: EngineStats = core.stats()
        self._snapshot_at = time.monotonic()
        # Queued reservations -> the future their caller awaits. Engine thread only.
        self._grant_waiters: dict[str, concurrent.futures.Future[list[int]]] = {}
        # Every reservation future not settled yet, its command still queued or not: the
        # engine thread's death (or shutdown) fails them all, so no caller waits on a
        # command that will never run. Added on the event loop, discarded by whichever
        # thread settles the future.
        self._unsettled: set[concurrent.futures.Future[list[int]]] = set()

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started_at = time.monotonic()
        self._busy_at_start = self.core.runner.busy_seconds
        # Serial mode: the engine thread only hands the loop to the compute thread.
        target = self._run if self.overlap else self._run_serial_on_compute_thread
        self._thread = threading.Thread(target=target, name="engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; open streams end with UnavailableError."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail_grant_waiters(self._unavailable())
        for stream in self._streams.values():
            stream.queue.put_nowait(UnavailableError("engine is shutting down"))
        self._streams.clear()

    # -- requests ---------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_kv: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Run a request; yields one output per step that produced something.

        Raises ValueError before anything is allocated if the request is invalid. If the
        consumer stops early (or is cancelled), the request is aborted and its blocks freed.
        """
        self._check_alive()
        req = self.core.make_request(request_id, prompt_token_ids, params, hold_kv=hold_kv)
        stream = self._open(request_id)
        self._submit("add", lambda: self.core.add_request(req), request_id)
        async for out in self._consume(request_id, stream):
            yield out

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        timeout_s: float | None = 0.0,
    ) -> tuple[KVLease, AsyncIterator[RequestOutput]]:
        """Reserve blocks for a prompt whose KV will arrive from a prefill worker.

        When the pool cannot take it now, the request waits in the engine's reservation
        FIFO (served as blocks free up, after preempted requests; no polling) for up to
        ``timeout_s`` seconds (None: no bound; 0: not at all). Raises
        ResourceExhaustedError (nothing reserved) when the wait ends or the FIFO is full,
        and UnavailableError when the engine thread dies or stops first (queued or not).
        The stream yields outputs after ``kv_ready``; closing it early aborts and frees
        the lease.
        """
        self._check_alive()
        req = self.core.make_request(request_id, prompt_token_ids, params)
        stream = self._open(request_id)
        fut: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
        queue = timeout_s is None or timeout_s > 0

        def run() -> None:
            try:
                sched = self.core.scheduler
                blocks = sched.queue_remote(req) if queue else sched.reserve_remote(req)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                _settle(fut, exc=exc)
                return
            if blocks is None:
                self._grant_waiters[request_id] = fut  # resolved by _grant_reserved
            else:
                _settle(fut, blocks)

        self._unsettled.add(fut)
        fut.add_done_callback(self._unsettled.discard)
        self._submit("reserve", run)
        if self._dead is not None or self._stopping:
            # The thread died (or began stopping) after _check_alive: the command may never
            # run, and the death path may have failed the futures before this one was added.
            _settle(fut, exc=self._unavailable())
        began = time.monotonic()
        try:
            try:
                blocks = await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s or None)
            except TimeoutError:
                raise ResourceExhaustedError(
                    f"request {request_id}: no KV blocks within {time.monotonic() - began:.1f} s "
                    f"(queued behind {self._snapshot.num_waiting} waiting request(s))"
                ) from None
        except BaseException:
            self._streams.pop(request_id, None)
            # Idempotent: frees a lease granted after this caller stopped waiting.
            self.abort(request_id)
            raise
        # Set on the engine thread before the grant resolved the future.
        reused = req.num_reused_blocks
        leased = blocks[reused:]
        generation = self.core.pool.generation(leased)
        lease = KVLease(request_id, leased, generation, first_block=reused)
        return lease, self._consume(request_id, stream)

    def kv_ready(self, request_id: str, first_token: int, generation: int | None = None) -> None:
        """The reserved blocks hold the prompt's KV and ``first_token`` was sampled.

        ``generation``: the lease's; if the blocks were reallocated since, the stream ends
        with AbortedError instead.
        """

        def run() -> None:
            out = self.core.scheduler.remote_kv_ready(request_id, first_token, generation)
            if out is not None:
                self._publish([out])

        self._submit("kv_ready", run, request_id)

    @property
    def num_streams(self) -> int:
        """Requests whose output stream is open here (generating, or awaiting their KV)."""
        return len(self._streams)

    def end_streams(self, error_for: Callable[[str], BaseException]) -> int:
        """End every open stream with ``error_for(request_id)``, raised to its consumer,
        whose leaving aborts the request and frees its blocks (a draining worker hands
        its requests back this way). Returns how many streams it ended."""
        ended = 0
        for request_id, stream in list(self._streams.items()):
            if not stream.done:
                stream.queue.put_nowait(error_for(request_id))
                ended += 1
        return ended

    def abort(self, request_id: str) -> None:
        """Stop a request in any state and free its blocks. Non-blocking, idempotent."""

        def run() -> None:
            self._grant_waiters.pop(request_id, None)  # its caller stopped waiting
            out = self.core.abort(request_id)
            if out is not None:
                self._publish([out])

        self._submit("abort", run, request_id)

    def discard(self, request_id: str) -> None:
        """Abort ``request_id`` and drop its output stream, whether or not it was ever
        iterated. For callers that will not read the stream again. Idempotent."""
        self._streams.pop(request_id, None)
        self.abort(request_id)

    def release_held(self, request_id: str) -> None:
        """Free the blocks a finished ``hold_kv`` request kept. Non-blocking, idempotent."""
        self._submit("release_held", lambda: self.core.scheduler.release_held(request_id))

    def stats(self) -> EngineStats:
        """The engine's latest published snapshot; never waits on the engine thread.

        Consistent (taken on the engine thread between steps) and at most one step or
        one command batch old.
        """
        return self._snapshot

    def computed_tokens(self, request_id: str) -> int:
        """Tokens of ``request_id`` computed so far (0 when unknown or finished).

        A lock-free read of one int the engine thread owns: possibly a step stale, never
        torn. For progress reports, not for decisions.
        """
        req = self.core.scheduler.requests.get(request_id)
        return req.num_computed_tokens if req is not None else 0

    @property
    def snapshot_age_s(self) -> float:
        """Seconds since the engine thread last published a snapshot (it publishes at
        least every half second while alive)."""
        return time.monotonic() - self._snapshot_at

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._stopping and self._thread is not None

    def busy_fraction(self) -> float:
        wall = time.monotonic() - self._started_at
        busy = self.core.runner.busy_seconds - self._busy_at_start
        return min(1.0, busy / wall) if wall > 0 else 0.0

    # -- plumbing on the event loop ---------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise UnavailableError(f"engine thread died: {self._dead!r}")
        if self._stopping or self._loop is None:
            raise UnavailableError("engine is not running")

    def _open(self, request_id: str) -> _Stream:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream()
        self._streams[request_id] = stream
        return stream

    async def _consume(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.done = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.done:
                self.abort(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(exc)
        if self.on_death is not None:
            self.on_death(exc)

    # -- the engine thread ------------------------------------------------------------

    def _submit(self, name: str, run: Callable[[], None], request_id: str | None = None) -> None:
        self._commands.put(_Command(name, run, request_id))
        self._wake.set()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command.run()
            except Exception as exc:
                self._command_failed(command, exc)

    def _command_failed(self, command: _Command, exc: Exception) -> None:
        """Fail the request the command was for and free what it holds; the engine and
        every other request go on."""
        rid = command.request_id
        if isinstance(exc, BatonError):
            logger.warning("request %s: engine command %s refused: %s", rid, command.name, exc)
        else:
            logger.exception("request %s: engine command %s failed", rid or "-", command.name)
        if rid is None:
            return
        if command.name != "abort":
            try:
                self.core.abort(rid)
            except Exception:
                logger.exception(
                    "request %s: abort after a failed %s failed too", rid, command.name
                )
        error: BatonError = (
            exc
            if isinstance(exc, BatonError)
            else InternalError(f"request {rid}: engine command {command.name} failed: {exc!r}")
        )
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail, rid, error)

    def _grant_reserved(self) -> None:
        """Serve the reservation FIFO with whatever blocks are free now."""
        for req in self.core.scheduler.grant_reserved():
            fut = self._grant_waiters.pop(req.request_id, None)
            if fut is not None:
                _settle(fut, req.block_ids)

    def _fail_grant_waiters(self, exc: BaseException) -> None:
        """Once the engine thread is gone: no queued reservation will ever be granted, and
        no reserve command still in the queue will ever run."""
        waiters, self._grant_waiters = self._grant_waiters, {}
        for fut in [*waiters.values(), *list(self._unsettled)]:
            _settle(fut, exc=exc)

    def _unavailable(self) -> UnavailableError:
        if self._dead is not None:
            return UnavailableError(f"engine thread died: {self._dead!r}")
        return UnavailableError("engine is shutting down")

    def _publish_stats(self) -> None:
        self._snapshot = self.core.stats()
        self._snapshot_at = time.monotonic()

    def _run_serial_on_compute_thread(self) -> None:
        self.core.runner.compute.call(self._run_serial)

    def _run_serial(self) -> None:
        core = self.core
        tl = self.timeline
        try:
            while not self._stopping:
                if not core.has_work():
                    core.runner.idle()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                self._drain()
                self._grant_reserved()
                if core.has_work():
                    with tl.span("schedule", ENGINE):
                        sched = core.scheduler.schedule()
                    if not sched.empty:
                        # Stats show what this step admitted while it computes.
                        self._publish_stats()
                        sampled = core.runner.run(core.runner.prepare(sched))
                        with tl.span("update", ENGINE):
                            self._publish(core.update(sched, sampled))
                        self._grant_reserved()
                self._publish_stats()
        except BaseException as exc:
            logger.exception("engine thread died")
            self._dead = exc
            self._fail_grant_waiters(UnavailableError(f"engine thread died: {exc!r}"))
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(
                    self._fail_all, UnavailableError(f"engine thread died: {exc!r}")
                )

    def _run(self) -> None:
        core = self.core
        tl = self.timeline
        inflight: tuple[SchedulerOutput, concurrent.futures.Future[Any]] | None = None
        # This thread builds each step's inputs while the compute thread runs the last.
        serial_torch_here()
        try:
            while not self._stopping:
                if inflight is None and not core.has_work():
                    core.runner.idle()  # lends its cores to workers beside it
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                self._drain()
                self._grant_reserved()
                nxt = None
                if core.has_work():
                    with tl.span("schedule", ENGINE):
                        sched = core.scheduler.schedule()
                    if not sched.empty:
                        step = core.runner.prepare(sched)
                        nxt = (sched, core.runner.submit_run(step))
                if inflight is not None:
                    sched, fut = inflight
                    with tl.span("wait", ENGINE):
                        sampled = fut.result()
                    with tl.span("update", ENGINE):
                        self._publish(core.update(sched, sampled))
                    self._grant_reserved()
                inflight = nxt
                self._publish_stats()
            if inflight is not None:
                inflight[1].result()
        except BaseException as exc:
            logger.exception("engine thread died")
            self._dead = exc
            self._fail_grant_waiters(UnavailableError(f"engine thread died: {exc!r}"))
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(
                    self._fail_all, UnavailableError(f"engine thread died: {exc!r}")
                )


def _settle(
    fut: concurrent.futures.Future[list[int]],
    result: list[int] | None = None,
    exc: BaseException | None = None,
) -> None:
    """Resolve ``fut`` unless its waiter gave up (cancelled it) first; that waiter aborts
    the request, which frees whatever was granted."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exc is not None:
            fut.set_exception(exc)
        else:
            assert result is not None
            fut.set_result(result)
