"""A Chrome/Perfetto timeline of one worker's engine loop and transfer worker.

The engine thread, the runner thread and the transfer threads each record spans on their
own track; a worker started with ``--timeline-file PATH`` writes them, on shutdown, as a
Chrome trace JSON (``{"traceEvents": [...]}``) that https://ui.perfetto.dev and
``chrome://tracing`` open. That is how the overlap the design promises is shown: the
runner's forward of step N under the engine thread's scheduling of step N+1, and KV
sends beside both.

Tracks (one per thread of work):

- ``engine loop``: ``schedule`` (the scheduler's decision for the next step), ``wait``
  (the engine thread idle until the step in flight is done) and ``update`` (applying a
  step's samples, publishing outputs);
- ``runner``: per step ``prepare`` (inputs built), ``forward`` (the model) and
  ``sample``; on a GPU these are launch times, and ``sample`` includes the wait for the
  device;
- ``kv send`` (prefill): each send job, queued blocks to the receiver's pool;
- ``kv receive`` (decode): each checksum ``verify`` on the receiver's thread, and each
  lease, granted to ended, as an async slice (leases overlap, one per request).

Recording is off unless a :class:`Timeline` is passed in: the engine's hooks then call
:data:`OFF`, whose methods do nothing (a call per hook, a few per step of milliseconds).
Timestamps are ``time.perf_counter_ns()``, which on Linux is the host's monotonic clock,
so the files of two workers on one host line up (``benchmarks.timeline_plot`` draws
them together). Events beyond ``max_events`` drop the oldest. Thread-safe: appending to a
deque is atomic.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ENGINE = "engine loop"
RUNNER = "runner"
SEND = "kv send"
RECEIVE = "kv receive"
TRACKS = (ENGINE, RUNNER, SEND, RECEIVE)  # in display order

DEFAULT_MAX_EVENTS = 1_000_000

# (name, track, start ns, duration ns, args or None, async id or None)
_Event = tuple[str, str, int, int, Mapping[str, Any] | None, str | None]


class TimelineRecorder:
    """What the engine's hooks call. This base records nothing (see :data:`OFF`)."""

    enabled = False

    def span(
        self, name: str, track: str, args: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """A span from entering the block to leaving it."""
        return _NOTHING

    def complete(
        self, name: str, track: str, start_ns: int, args: Mapping[str, Any] | None = None
    ) -> None:
        """A span from ``start_ns`` (``time.perf_counter_ns()``) to now."""

    def interval(
        self,
        name: str,
        track: str,
        start_ns: int,
        key: str,
        args: Mapping[str, Any] | None = None,
    ) -> None:
        """Like :meth:`complete`, for spans that overlap others on their track (one per
        ``key``, e.g. a request id): drawn as async slices."""


_NOTHING = contextlib.nullcontext()
OFF = TimelineRecorder()


class Timeline(TimelineRecorder):
    """Records spans; :meth:`write` saves them as a Chrome trace. ``process`` names the
    worker in the viewer (``prefill``, ``decode``)."""

    enabled = True

    def __init__(self, process: str, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.process = process
        self._events: deque[_Event] = deque(maxlen=max_events)
        self._recorded = 0
        # Where perf_counter's clock was at a known wall-clock time, to line files up
        # with logs and traces.
        self._anchor = (time.perf_counter_ns(), time.time_ns())

    @contextlib.contextmanager
    def span(self, name: str, track: str, args: Mapping[str, Any] | None = None) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.complete(name, track, start, args)

    def complete(
        self, name: str, track: str, start_ns: int, args: Mapping[str, Any] | None = None
    ) -> None:
        self._add(name, track, start_ns, args, None)

    def interval(
        self,
        name: str,
        track: str,
        start_ns: int,
        key: str,
        args: Mapping[str, Any] | None = None,
    ) -> None:
        self._add(name, track, start_ns, args, key)

    def _add(
        self,
        name: str,
        track: str,
        start_ns: int,
        args: Mapping[str, Any] | None,
        key: str | None,
    ) -> None:
        dur = time.perf_counter_ns() - start_ns
        self._events.append((name, track, start_ns, dur, args, key))
        self._recorded += 1

    @property
    def num_dropped(self) -> int:
        """Events recorded but no longer held (past ``max_events``)."""
        return self._recorded - len(self._events)

    def events(self) -> list[_Event]:
        return list(self._events)

    def to_chrome(self) -> dict[str, Any]:
        """The Chrome trace event format: complete ("X") events in microseconds, one
        thread per track, plus metadata naming the process and the tracks."""
        pid = os.getpid()
        tid = {track: i + 1 for i, track in enumerate(TRACKS)}
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": self.process}}
        ]
        for track, n in tid.items():
            meta = {"ph": "M", "pid": pid, "tid": n}
            out.append({**meta, "name": "thread_name", "args": {"name": track}})
            out.append({**meta, "name": "thread_sort_index", "args": {"sort_index": n}})
        for name, track, start, dur, args, key in self.events():
            event: dict[str, Any] = {
                "name": name,
                "cat": track,
                "pid": pid,
                "tid": tid.get(track, len(tid) + 1),
                "ts": start / 1000,
            }
            if args:
                event["args"] = dict(args)
            if key is None:
                out.append({**event, "ph": "X", "dur": dur / 1000})
            else:  # an async pair: begin, and end at start + dur
                out.append({**event, "ph": "b", "id": key})
                out.append(
                    {
                        "ph": "e",
                        "name": name,
                        "cat": track,
                        "pid": pid,
                        "tid": event["tid"],
                        "ts": (start + dur) / 1000,
                        "id": key,
                    }
                )
        perf_ns, wall_ns = self._anchor
        return {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {
                "process": self.process,
                "clock": "perf_counter_ns / 1000 (host monotonic clock, microseconds)",
                "anchor_perf_counter_ns": perf_ns,
                "anchor_wall_time_ns": wall_ns,
                "dropped_events": self.num_dropped,
            },
        }

    def write(self, path: Path) -> None:
        """Save the timeline (atomically: a reader never sees half a file)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_chrome()))
        os.replace(tmp, path)
