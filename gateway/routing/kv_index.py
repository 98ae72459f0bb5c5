"""The gateway's index of the prefix-cache blocks each worker holds, from its KV events.

Per worker: the block size its hashes are over, the last event batch applied, and the set
of chained block hashes it holds (bounded: a worker cannot hold more blocks than its pool
has, and the index keeps at most ``max_hashes`` per worker whatever a worker sends). A
snapshot replaces a worker's set; a batch applies on top only if it is the next one, and
otherwise reports a gap, upon which the feed subscribes again (and gets a snapshot). A
worker that leaves its fleet, or restarts, loses its entries.

Routing asks :meth:`KVIndex.cached_tokens`: how many of a prompt's leading tokens a worker
holds, counting whole blocks from the start (a chained hash implies every block before it;
the walk stops at the first miss). Pure: no gRPC, no event loop.

Events report blocks once they are computed, seconds after the gateway sent their prompt
to a worker. Meanwhile, a burst of prompts sharing a new prefix (a system prompt, a
group's first turns) would each see it cached nowhere and be spread over the workers,
each of which would compute it again. So the router also tells the index what it just
sent where (:meth:`KVIndex.expect`): those blocks count as held there until the worker's
events confirm them, or for ``expect_ttl_s`` (a prompt that failed, or was evicted at
once, stops attracting its followers then). Expectations are bounded per worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_events import prefix_block_hashes

# Hashes kept per worker at most (a 1 GiB pool of SmolLM2's bf16 blocks is ~2,900).
MAX_HASHES = 1 << 20
# Expected blocks kept per worker at most, and how long one counts unconfirmed: longer
# than a loaded worker's queue plus a long prompt's prefill, short enough that a prompt
# that never ran stops steering others soon.
MAX_EXPECTED = 1 << 16
EXPECT_TTL_S = 30.0


@dataclass(slots=True)
class _WorkerCache:
    block_size: int
    seq: int
    hashes: set[int] = field(default_factory=set)
    # Blocks sent here to compute, not yet confirmed by an event: hash -> expiry
    # (clock time), in expiry order (each is inserted anew with the same TTL).
    expected: dict[int, float] = field(default_factory=dict)


class PromptHashes:
    """A prompt's chained block hashes, computed once per block size it is asked for."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._by_size: dict[int, list[int]] = {}

    def of(self, block_size: int) -> list[int]:
        hashes = self._by_size.get(block_size)
        if hashes is None:
            hashes = self._by_size[block_size] = prefix_block_hashes(self.token_ids, block_size)
        return hashes


class KVIndex:
    def __init__(
        self,
        max_hashes: int = MAX_HASHES,
        *,
        max_expected: int = MAX_EXPECTED,
        expect_ttl_s: float = EXPECT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be >= 1, got {max_hashes}")
        if max_expected < 0:
            raise ValueError(f"max_expected must be >= 0, got {max_expected}")
        if not expect_ttl_s >= 0:
            raise ValueError(f"expect_ttl_s must be >= 0, got {expect_ttl_s}")
        self.max_hashes = max_hashes
        self.max_expected = max_expected
        self.expect_ttl_s = expect_ttl_s
        self._clock = clock
        self._workers: dict[str, _WorkerCache] = {}

    def apply(
        self,
        address: str,
        *,
        seq: int,
        snapshot: bool,
        stored: Iterable[int],
        removed: Iterable[int],
        block_size: int,
    ) -> bool:
        """Take one event batch of ``address``; False (and nothing applied) when it does
        not follow the last one: the caller must subscribe again."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if snapshot:
            old = self._workers.get(address)
            cache = _WorkerCache(block_size, seq)
            if old is not None and old.block_size == block_size:
                cache.expected = old.expected  # what the gateway sent there still runs
            self._add(cache, stored)
            self._workers[address] = cache
            return True
        cache = self._workers.get(address)
        if cache is None or seq != cache.seq + 1 or block_size != cache.block_size:
            return False
        cache.seq = seq
        removed = list(removed)
        cache.hashes.difference_update(removed)
        for h in removed:
            cache.expected.pop(h, None)
        self._add(cache, stored)
        return True

    def _add(self, cache: _WorkerCache, stored: Iterable[int]) -> None:
        for h in stored:
            cache.expected.pop(h, None)  # confirmed
            if len(cache.hashes) < self.max_hashes:
                cache.hashes.add(h)

    def expect(self, address: str, prompt: PromptHashes) -> None:
        """The gateway just sent ``prompt`` to ``address`` to compute: its full blocks
        count as held there until events confirm them or ``expect_ttl_s`` passes. Nothing
        happens for a worker whose events have not begun (its block size is unknown)."""
        cache = self._workers.get(address)
        if cache is None or not self.max_expected:
            return
        now = self._clock()
        expires = now + self.expect_ttl_s
        expected = cache.expected
        for h in prompt.of(cache.block_size):
            if h not in cache.hashes:
                expected.pop(h, None)  # to the end: the dict stays in expiry order
                expected[h] = expires
        # Expired ones first, then the oldest, until within the bound.
        while expected:
            h, until = next(iter(expected.items()))
            if until > now and len(expected) <= self.max_expected:
                break
            del expected[h]

    def drop(self, address: str) -> None:
        """Forget ``address`` (it left its fleet, restarted, or its stream broke)."""
        self._workers.pop(address, None)

    def known(self, address: str) -> bool:
        return address in self._workers

    def num_hashes(self, address: str) -> int:
        cache = self._workers.get(address)
        return len(cache.hashes) if cache is not None else 0

    def num_expected(self, address: str) -> int:
        """Blocks expected at ``address`` and not yet confirmed (expired ones included
        until the next :meth:`expect` sweeps them)."""
        cache = self._workers.get(address)
        return len(cache.expected) if cache is not None else 0

    def cached_tokens(self, address: str, prompt: PromptHashes, *, expected: bool = True) -> int:
        """Leading tokens of the prompt whose KV ``address`` holds or (``expected``) is
        computing for a prompt the gateway sent there (whole blocks)."""
        cache = self._workers.get(address)
        if cache is None:
            return 0
        hits = 0
        now = None
        for h in prompt.of(cache.block_size):
            if h not in cache.hashes:
                until = cache.expected.get(h) if expected else None
                if until is None:
                    break
                if now is None:
                    now = self._clock()
                if until <= now:
                    break
            hits += 1
        return hits * cache.block_size
