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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_events import prefix_block_hashes

# Hashes kept per worker at most (a 1 GiB pool of SmolLM2's bf16 blocks is ~2,900).
MAX_HASHES = 1 << 20


@dataclass(slots=True)
class _WorkerCache:
    block_size: int
    seq: int
    hashes: set[int] = field(default_factory=set)


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
    def __init__(self, max_hashes: int = MAX_HASHES) -> None:
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be >= 1, got {max_hashes}")
        self.max_hashes = max_hashes
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
            cache = _WorkerCache(block_size, seq)
            self._add(cache, stored)
            self._workers[address] = cache
            return True
        cache = self._workers.get(address)
        if cache is None or seq != cache.seq + 1 or block_size != cache.block_size:
            return False
        cache.seq = seq
        cache.hashes.difference_update(removed)
        self._add(cache, stored)
        return True

    def _add(self, cache: _WorkerCache, stored: Iterable[int]) -> None:
        for h in stored:
            if len(cache.hashes) >= self.max_hashes:
                return
            cache.hashes.add(h)

    def drop(self, address: str) -> None:
        """Forget ``address`` (it left its fleet, restarted, or its stream broke)."""
        self._workers.pop(address, None)

    def known(self, address: str) -> bool:
        return address in self._workers

    def num_hashes(self, address: str) -> int:
        cache = self._workers.get(address)
        return len(cache.hashes) if cache is not None else 0

    def cached_tokens(self, address: str, prompt: PromptHashes) -> int:
        """Leading tokens of the prompt whose KV ``address`` holds (whole blocks)."""
        cache = self._workers.get(address)
        if cache is None:
            return 0
        hits = 0
        for h in prompt.of(cache.block_size):
            if h not in cache.hashes:
                break
            hits += 1
        return hits * cache.block_size
