"""The KV events a worker publishes: which prefix-cache block hashes it stores and evicts.

The block pool (engine thread) reports each chained block hash it registers in its prefix
cache and each one it drops; the engine closes a batch after every step. Readers (the
worker's ``KVEvents`` stream, on the event loop) ask for the batches after the last
sequence number they saw; one that fell behind the bounded history gets a snapshot of
every hash held now instead, stamped with the sequence number it is current at, so a
reader's view is always "snapshot at N, then batches N+1, N+2, ...". Thread-safe: one
lock, held for list appends and copies only.

The hashes are the engine's own (``engine.block_pool.hash_block``: chained over token
ids, from ``ROOT_HASH``), so anyone who knows the block size can compute them for a
token sequence: the gateway does, to route a prompt where its prefix is cached.
Torch-free.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.block_pool import ROOT_HASH, hash_block

# Batches kept for readers that are behind; one further back gets a snapshot.
HISTORY = 256


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """Hashes stored and removed in one engine step (``snapshot``: every hash held at
    ``seq``, and nothing removed)."""

    seq: int
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    snapshot: bool = False


@dataclass(slots=True)
class KVEventLog:
    """Written by the engine thread, read by any thread."""

    history: int = HISTORY
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _held: set[int] = field(default_factory=set)
    _stored: list[int] = field(default_factory=list)
    _removed: list[int] = field(default_factory=list)
    _batches: deque[KVEventBatch] = field(default_factory=deque)
    _seq: int = 0

    def stored(self, block_hash: int) -> None:
        with self._lock:
            self._held.add(block_hash)
            self._stored.append(block_hash)

    def removed(self, block_hash: int) -> None:
        with self._lock:
            self._held.discard(block_hash)
            self._removed.append(block_hash)

    def close_batch(self) -> None:
        """End the current batch (after an engine step); a no-op when nothing happened."""
        with self._lock:
            if not self._stored and not self._removed:
                return
            self._seq += 1
            self._batches.append(KVEventBatch(self._seq, tuple(self._stored), tuple(self._removed)))
            self._stored.clear()
            self._removed.clear()
            while len(self._batches) > self.history:
                self._batches.popleft()

    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    def since(self, seq: int | None) -> list[KVEventBatch]:
        """The batches after ``seq``; a snapshot first when ``seq`` is None or older than
        the history kept (the reader must then replace what it knew)."""
        with self._lock:
            oldest = self._batches[0].seq if self._batches else self._seq + 1
            if seq is not None and seq >= oldest - 1:
                return [b for b in self._batches if b.seq > seq]
            # Events not yet in a closed batch are already in _held: the snapshot is
            # current at the next seq, which will carry them again (harmless: storing a
            # held hash twice, or removing one that is gone, changes nothing).
            return [KVEventBatch(self._seq, tuple(self._held), snapshot=True)]


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of ``token_ids``' full blocks, as a worker's prefix cache keys
    them."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
