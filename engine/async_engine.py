"""The asyncio face of the engine, and the engine thread behind it.

The engine thread owns the scheduler and block pool outright; asyncio code never touches
them. It talks to the thread through a command queue (add, abort, reserve, KV ready,
release) and gets outputs back through ``call_soon_threadsafe``, so the event loop never
blocks on a step.

Steps overlap: while step N computes on the runner's compute thread (the thread that
also loaded the model: ``engine.compute_thread``), the engine thread schedules step N+1
and builds its input tensors (tokens that N will sample are *pending* and the runner
fills them in), queues it behind N, and only then waits for N and applies its results.
So the runner starts N+1 the moment N's samples exist, and the engine thread's work
(commands, scheduling, input preparation, updates, handing outputs to asyncio) falls
inside the forward of the step after. That is what a GPU wants. On a 2-core CPU the
forward's OpenMP threads hold both cores and the engine's work is under 2% of a W1 step
(``benchmarks/w1_profile.py``: the synchronous loop keeps a forward in flight 98% of
the time), so overlap can win at most that much there; ``overlap=False`` instead runs
the whole loop on the compute thread, one step after another. The busy fraction is the
share of wall time with a forward in flight, measured by the runner the same way as in
the synchronous loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.engine_core import EngineCore
from engine.errors import UnavailableError
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVLease:
    """Blocks reserved on this engine for a request whose KV a prefill worker will write."""

    request_id: str
    block_ids: list[int]
    epochs: list[int]


class _Stream:
    """Per-request output channel living on the event loop."""

    __slots__ = ("queue", "done")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.done = False


class AsyncEngine:
    def __init__(self, core: EngineCore, *, overlap: bool = True):
        """``overlap``: schedule and prepare step N+1 on the engine thread while step N
        computes (the default). False runs the whole loop on the runner's compute thread,
        one step after another like ``EngineCore.step``, so that nothing but the forward
        runs while the forward's OpenMP threads hold both of a small CPU's cores."""
        self.core = core
        self.overlap = overlap
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._started_at = time.monotonic()
        self._busy_at_start = 0.0

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
        self._submit(lambda: self.core.add_request(req))
        async for out in self._consume(request_id, stream):
            yield out

    async def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[KVLease, AsyncIterator[RequestOutput]]:
        """Reserve blocks for a prompt whose KV will arrive from a prefill worker.

        Raises ResourceExhaustedError (nothing reserved) when the pool is full. The stream
        yields outputs after ``kv_ready``; closing it early aborts and frees the lease.
        """
        self._check_alive()
        req = self.core.make_request(request_id, prompt_token_ids, params)
        stream = self._open(request_id)
        fut: concurrent.futures.Future[list[int]] = concurrent.futures.Future()

        def run() -> None:
            try:
                blocks = self.core.scheduler.reserve_remote(req)
                fut.set_result(blocks)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                fut.set_exception(exc)

        self._submit(run)
        try:
            blocks = await asyncio.wrap_future(fut)
        except BaseException:
            self._streams.pop(request_id, None)
            # Idempotent: frees a lease granted after this caller stopped waiting.
            self.abort(request_id)
            raise
        epochs = [self.core.pool.epoch(b) for b in blocks]
        return KVLease(request_id, blocks, epochs), self._consume(request_id, stream)

    def kv_ready(self, request_id: str, first_token: int) -> None:
        """The reserved blocks hold the prompt's KV and ``first_token`` was sampled."""

        def run() -> None:
            out = self.core.scheduler.remote_kv_ready(request_id, first_token)
            if out is not None:
                self.core.runner.forget([request_id])
                self._publish([out])

        self._submit(run)

    def abort(self, request_id: str) -> None:
        """Stop a request in any state and free its blocks. Non-blocking, idempotent."""

        def run() -> None:
            out = self.core.abort(request_id)
            if out is not None:
                self._publish([out])

        self._submit(run)

    def discard(self, request_id: str) -> None:
        """Abort ``request_id`` and drop its output stream, whether or not it was ever
        iterated. For callers that will not read the stream again. Idempotent."""
        self._streams.pop(request_id, None)
        self.abort(request_id)

    def release_held(self, request_id: str) -> None:
        """Free the blocks a finished ``hold_kv`` request kept. Non-blocking, idempotent."""
        self._submit(lambda: self.core.scheduler.release_held(request_id))

    async def stats(self) -> EngineStats:
        """A consistent snapshot taken on the engine thread."""
        fut: concurrent.futures.Future[EngineStats] = concurrent.futures.Future()
        self._submit(lambda: fut.set_result(self.core.stats()))
        return await asyncio.wrap_future(fut)

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

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(exc)

    # -- the engine thread ------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
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
                command()
            except Exception:
                logger.exception("engine command failed")

    def _run_serial_on_compute_thread(self) -> None:
        self.core.runner.compute.call(self._run_serial)

    def _run_serial(self) -> None:
        core = self.core
        try:
            while not self._stopping:
                if not core.has_work():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                self._drain()
                if core.has_work():
                    sched = core.scheduler.schedule()
                    if not sched.empty:
                        sampled = core.runner.run(core.runner.prepare(sched))
                        self._publish(core.update(sched, sampled))
        except BaseException as exc:
            logger.exception("engine thread died")
            self._dead = exc
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(
                    self._fail_all, UnavailableError(f"engine thread died: {exc!r}")
                )

    def _run(self) -> None:
        core = self.core
        inflight: tuple[SchedulerOutput, concurrent.futures.Future[Any]] | None = None
        try:
            while not self._stopping:
                if inflight is None and not core.has_work():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                self._drain()
                nxt = None
                if core.has_work():
                    sched = core.scheduler.schedule()
                    if not sched.empty:
                        step = core.runner.prepare(sched)
                        nxt = (sched, core.runner.submit_run(step))
                if inflight is not None:
                    sched, fut = inflight
                    self._publish(core.update(sched, fut.result()))
                inflight = nxt
            if inflight is not None:
                inflight[1].result()
        except BaseException as exc:
            logger.exception("engine thread died")
            self._dead = exc
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(
                    self._fail_all, UnavailableError(f"engine thread died: {exc!r}")
                )
