"""Stop strings over a stream of text deltas.

A stop string may arrive split across deltas ("ST" + "OP"), so text that could be the
start of one is held back until it either completes a stop string or cannot any more.
Text already emitted therefore never contains the beginning of a match, and a search over
held + new text finds every match. The first match to complete wins: the output ends at
its start, or at its end when the stop string is to be included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopCheck:
    """The outcome of one :meth:`StopStringMatcher.feed`."""

    text: str  # safe to emit now
    stop: str | None = None  # the stop string that matched; the stream ends here

    @property
    def hit(self) -> bool:
        return self.stop is not None


class StopStringMatcher:
    """Holds back and truncates one request's text. Not thread-safe; one per request.

    ``feed`` may not be called after it reported a hit; ``flush`` returns the held text
    at the end of a stream that ended without a hit.
    """

    def __init__(self, stops: Sequence[str], *, include_in_output: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._include = include_in_output
        # Every proper prefix of every stop string: a held-back tail must be one of these.
        self._prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._stopped = False

    @property
    def active(self) -> bool:
        return bool(self._stops)

    @property
    def held(self) -> str:
        """Text withheld because it may start a stop string."""
        return self._held

    def feed(self, delta: str, *, check: bool = True) -> StopCheck:
        """Add ``delta``; return what may be emitted and whether a stop string matched.

        With ``check=False`` (e.g. before min_tokens) no match is reported, but a possible
        start of one is still held back, so a match completed later is found whole.
        """
        if self._stopped:
            raise RuntimeError("feed() called after a stop string matched")
        if not self._stops:
            return StopCheck(delta)
        text = self._held + delta
        if check:
            match = self._first_match(text)
            if match is not None:
                start, stop = match
                self._stopped, self._held = True, ""
                end = start + len(stop) if self._include else start
                return StopCheck(text[:end], stop)
        keep = self._held_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopCheck(text[: len(text) - keep])

    def flush(self) -> str:
        """The held text, released because the stream ended without completing a match."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that could begin a stop string."""
        for k in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0
