"""The KV block pool: free list, reference counts, prefix cache. Integer block ids only.

Owned by the engine thread alone, so it needs no locks. Torch-free.

Free blocks sit in one LRU queue. A free block may still hold a cached prefix (its hash
stays registered) until it is reused for something else, so a later request with the
same prefix can revive it. Allocation, free and revival are O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_events import KVEventLog

# Parent hash of the first block of every sequence.
ROOT_HASH = 0
# Parent block of the first block of every sequence.
NO_PARENT = -1


def epoch_digest(epochs: Sequence[int], block_ids: Sequence[int]) -> int:
    """A 63-bit, process-independent digest of (block id, epoch) pairs; never 0."""
    h = 0xCBF29CE484222325
    for block_id, epoch in zip(block_ids, epochs, strict=True):
        for value in (block_id, epoch):
            h = ((h ^ value) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return (h >> 1) or 1


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained hash of a full block: it depends on every token before it, too."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(slots=True)
class _CachedKey:
    """What a cached block's KV was computed from: exactly these tokens, right after the
    block ``parent_block`` as it was in allocation ``parent_epoch``.

    The hash only indexes the cache. A hit must also match this identity, so even a hash
    collision can never serve KV that was computed after a different prefix.
    """

    parent_hash: int
    parent_block: int
    parent_epoch: int
    token_ids: tuple[int, ...]


class BlockPool:
    """Fixed-size KV blocks with reference counts and a chained-hash prefix cache.

    Contract: ``allocate`` is all-or-nothing; every id it returns has ref count 1 and
    must be given back exactly once through ``free``. ``share`` adds a reference to
    blocks found by ``match_prefix``; each reference is freed separately. Freeing a
    block more often than it was referenced is a bug and raises AssertionError.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        # Bumped at every allocation: a lease on a block names the epoch it was given in.
        self._epoch = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_of: list[int | None] = [None] * num_blocks
        self._key_of: list[_CachedKey | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block id
        # A full block whose content is already cached in another block: that block
        # stands for it as the parent of later blocks of the same sequence.
        self._twin: list[int] = [NO_PARENT] * num_blocks
        self._twin_epoch = [0] * num_blocks
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        # Told of every hash the prefix cache registers or drops (the worker's KV events).
        self.events = events

    # -- capacity ---------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (cached-but-free ones included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def epoch(self, block_id: int) -> int:
        return self._epoch[block_id]

    def generation(self, block_ids: Sequence[int]) -> int:
        """A 63-bit digest of the blocks' allocation epochs: it changes as soon as any of
        them is freed and allocated again, so a lease that names it can tell stale blocks."""
        return epoch_digest([self._epoch[b] for b in block_ids], block_ids)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # -- allocation -------------------------------------------------------------------

    def allocate(self, n: int, avoid: Set[int] = frozenset()) -> list[int] | None:
        """``n`` fresh blocks with ref count 1, or None (and no change) if too few are free.

        Free blocks in ``avoid`` are skipped and keep their place in the LRU order.
        """
        assert n >= 0
        if n > len(self._free) - sum(1 for b in avoid if b in self._free):
            return None
        out: list[int] = []
        passed: list[int] = []
        while len(out) < n:
            block_id, _ = self._free.popitem(last=False)
            if block_id in avoid:
                passed.append(block_id)
                continue
            self._evict(block_id)
            self._ref[block_id] = 1
            self._epoch[block_id] += 1
            out.append(block_id)
        for block_id in reversed(passed):  # back to the head, in their old order
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become reusable.

        Freed in reverse so a sequence's tail blocks are evicted before its head, which
        is the part other requests are likeliest to share.
        """
        for block_id in reversed(block_ids):
            ref = self._ref[block_id]
            assert ref > 0, f"double free of block {block_id}"
            self._ref[block_id] = ref - 1
            if ref == 1:
                self._free[block_id] = None

    # -- prefix cache -----------------------------------------------------------------

    def match_prefix(
        self, block_hashes: Sequence[int], keys: Sequence[tuple[int, ...]]
    ) -> list[int]:
        """Longest run of cached blocks holding exactly the KV of ``keys`` (one token tuple
        per full block, from the sequence start), indexed by ``block_hashes``.

        Does not take references; call ``share`` on the result to keep the blocks.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent, parent_epoch = NO_PARENT, 0
        for h, tokens in zip(block_hashes, keys, strict=True):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            key = self._key_of[block_id]
            if (
                key is None
                or key.parent_block != parent
                or key.parent_epoch != parent_epoch
                or key.token_ids != tokens
            ):
                break
            hits.append(block_id)
            parent, parent_epoch = block_id, self._epoch[block_id]
        return hits

    def share(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block (reviving cached free blocks)."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def canonical(self, block_id: int) -> int:
        """The cached block that holds ``block_id``'s content (itself, or its twin)."""
        twin = self._twin[block_id]
        # A twin reallocated since is no longer the same content.
        if twin == NO_PARENT or self._epoch[twin] != self._twin_epoch[block_id]:
            return block_id
        return twin

    def cache_block(
        self,
        block_id: int,
        parent_hash: int,
        token_ids: Sequence[int],
        parent_block: int = NO_PARENT,
    ) -> int:
        """Register a full, written block; returns its chained hash.

        ``parent_block`` is the sequence's previous block (``canonical`` of it), or
        NO_PARENT for a first block. If identical content is already cached in another
        block, that block becomes this one's twin and this one stays unregistered.
        """
        h = hash_block(parent_hash, token_ids)
        if not self.enable_prefix_caching:
            return h
        assert self._ref[block_id] > 0, f"caching free block {block_id}"
        if self._hash_of[block_id] is not None or self._twin[block_id] != NO_PARENT:
            return h
        parent_epoch = self._epoch[parent_block] if parent_block != NO_PARENT else 0
        key = _CachedKey(parent_hash, parent_block, parent_epoch, tuple(token_ids))
        existing = self._cached.get(h)
        if existing is None:
            self._cached[h] = block_id
            self._hash_of[block_id] = h
            self._key_of[block_id] = key
            if self.events is not None:
                self.events.stored(h)
        elif self._key_of[existing] == key:
            self._twin[block_id] = existing
            self._twin_epoch[block_id] = self._epoch[existing]
        return h

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_query_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> None:
        for h, block_id in self._cached.items():
            self._hash_of[block_id] = None
            self._key_of[block_id] = None
            if self.events is not None:
                self.events.removed(h)
        self._cached.clear()
        self._twin = [NO_PARENT] * self.num_blocks

    def _evict(self, block_id: int) -> None:
        self._twin[block_id] = NO_PARENT
        h = self._hash_of[block_id]
        if h is not None:
            if self._cached.get(h) == block_id:
                del self._cached[h]
                if self.events is not None:
                    self.events.removed(h)
            self._hash_of[block_id] = None
            self._key_of[block_id] = None
