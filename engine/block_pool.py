"""The KV block pool: free list, reference counts, prefix cache. Integer block ids only.

Owned by the engine thread alone, so it needs no locks. Torch-free.

Free blocks sit in one LRU queue. A free block may still hold a cached prefix (its hash
stays registered) until it is reused for something else, so a later request with the
same prefix can revive it. Allocation, free and revival are O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Parent hash of the first block of every sequence.
ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained hash of a full block: it depends on every token before it, too."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(slots=True)
class _CachedKey:
    parent_hash: int
    token_ids: tuple[int, ...]


class BlockPool:
    """Fixed-size KV blocks with reference counts and a chained-hash prefix cache.

    Contract: ``allocate`` is all-or-nothing; every id it returns has ref count 1 and
    must be given back exactly once through ``free``. ``share`` adds a reference to
    blocks found by ``match_prefix``; each reference is freed separately. Freeing a
    block more often than it was referenced is a bug and raises AssertionError.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
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
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

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

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # -- allocation -------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with ref count 1, or None (and no change) if too few are free."""
        assert n >= 0
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref[block_id] = 1
            self._epoch[block_id] += 1
            out.append(block_id)
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

    def match_prefix(self, block_hashes: Sequence[int], keys: Sequence[tuple[int, ...]]) -> list[int]:
        """Longest run of cached blocks matching ``block_hashes`` (and their exact tokens).

        Does not take references; call ``share`` on the result to keep the blocks.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = ROOT_HASH
        for h, tokens in zip(block_hashes, keys, strict=True):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            key = self._key_of[block_id]
            # A 64-bit hash can collide; serving another prompt's KV would be silent
            # garbage, so the tokens themselves must match.
            if key is None or key.parent_hash != parent or key.token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def share(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block (reviving cached free blocks)."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def cache_block(self, block_id: int, parent_hash: int, token_ids: Sequence[int]) -> int:
        """Register a full, written block under its chained hash; returns the hash."""
        h = hash_block(parent_hash, token_ids)
        if not self.enable_prefix_caching:
            return h
        assert self._ref[block_id] > 0, f"caching free block {block_id}"
        if self._hash_of[block_id] is not None:
            return h
        if h not in self._cached:
            self._cached[h] = block_id
            self._hash_of[block_id] = h
            self._key_of[block_id] = _CachedKey(parent_hash, tuple(token_ids))
        return h

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_query_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._cached.values()):
            self._hash_of[block_id] = None
            self._key_of[block_id] = None
        self._cached.clear()

    def _evict(self, block_id: int) -> None:
        h = self._hash_of[block_id]
        if h is not None:
            if self._cached.get(h) == block_id:
                del self._cached[h]
            self._hash_of[block_id] = None
            self._key_of[block_id] = None
