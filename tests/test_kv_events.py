"""KV events without gRPC: the engine's log of stored and evicted prefix-cache hashes, the
gateway's index built from it, and the hashes both compute for the same tokenized text."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.block_pool import BlockPool
from engine.kv_events import KVEventLog, prefix_block_hashes
from engine.sampling_params import SamplingParams
from gateway.routing.kv_index import KVIndex, PromptHashes
from gateway.served_model import ServedModel
from tests.engine_helpers import make_core


def _replay(log: KVEventLog, index: KVIndex, address: str, seq: int | None) -> int | None:
    for b in log.since(seq):
        assert index.apply(
            address,
            seq=b.seq,
            snapshot=b.snapshot,
            stored=b.stored,
            removed=b.removed,
            block_size=4,
        )
        seq = b.seq
    return seq


def test_the_pool_reports_what_its_cache_stores_and_evicts() -> None:
    log = KVEventLog()
    pool = BlockPool(4, 4, events=log)
    blocks = pool.allocate(2)
    assert blocks is not None
    h0 = pool.cache_block(blocks[0], 0, [1, 2, 3, 4])
    h1 = pool.cache_block(blocks[1], h0, [5, 6, 7, 8], blocks[0])
    log.close_batch()
    (batch,) = log.since(0)
    assert (batch.seq, batch.stored, batch.removed) == (1, (h0, h1), ())
    pool.free(blocks)  # freed blocks stay cached until they are reused
    log.close_batch()
    assert log.since(1) == []
    assert pool.allocate(4) is not None  # reuses both: their hashes go
    log.close_batch()
    (batch,) = log.since(1)
    assert sorted(batch.removed) == sorted([h0, h1])


def test_a_reader_behind_the_history_gets_a_snapshot_of_what_is_held() -> None:
    log = KVEventLog(history=2)
    for h in range(1, 6):
        log.stored(h)
        log.close_batch()
    log.removed(3)
    log.close_batch()
    assert [b.seq for b in log.since(4)] == [5, 6]
    (snap,) = log.since(1)
    assert snap.snapshot and snap.seq == 6 and sorted(snap.stored) == [1, 2, 4, 5]
    (first,) = log.since(None)
    assert first.snapshot


def test_the_index_follows_snapshots_and_batches_and_reports_a_gap() -> None:
    log, index = KVEventLog(), KVIndex()
    prompt = list(range(100, 113))  # three full blocks of 4, and one token more
    hashes = prefix_block_hashes(prompt, 4)
    assert len(hashes) == 3
    for h in hashes[:2]:
        log.stored(h)
    log.close_batch()
    seq = _replay(log, index, "w", None)
    assert index.cached_tokens("w", PromptHashes(prompt)) == 8
    log.stored(hashes[2])
    log.close_batch()
    seq = _replay(log, index, "w", seq)
    assert index.cached_tokens("w", PromptHashes(prompt)) == 12
    # The first block goes: nothing of the prompt counts any more (the chain is broken).
    log.removed(hashes[0])
    log.close_batch()
    _replay(log, index, "w", seq)
    assert index.cached_tokens("w", PromptHashes(prompt)) == 0
    # A batch that skips one is refused and changes nothing.
    before = index.num_hashes("w")
    assert not index.apply("w", seq=99, snapshot=False, stored=[1], removed=[], block_size=4)
    assert index.num_hashes("w") == before
    index.drop("w")
    assert not index.known("w") and index.cached_tokens("w", PromptHashes(prompt)) == 0


def test_the_index_is_bounded_per_worker() -> None:
    index = KVIndex(max_hashes=3)
    index.apply("w", seq=1, snapshot=True, stored=range(10), removed=(), block_size=4)
    assert index.num_hashes("w") == 3
    with pytest.raises(ValueError, match="max_hashes"):
        KVIndex(max_hashes=0)


def test_gateway_and_worker_hash_real_text_alike(
    tiny_llama: Path, served_smollm2: ServedModel
) -> None:
    """The gateway tokenizes and hashes; the worker's engine caches the same prompt: every
    full block's hash the gateway computes is one the worker reported storing."""
    text = "The quick brown fox jumps over the lazy dog. " * 12
    ids = served_smollm2.tokenizer._encode(text, False)
    core = make_core(tiny_llama)
    core.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    index = KVIndex()
    for b in core.kv_events.since(None):
        index.apply(
            "w",
            seq=b.seq,
            snapshot=b.snapshot,
            stored=b.stored,
            removed=b.removed,
            block_size=core.layout.block_size,
        )
    bs = core.layout.block_size
    full = len(ids) // bs * bs
    assert full >= 4 * bs
    assert index.cached_tokens("w", PromptHashes(ids)) == full
    # Another prompt sharing only the first two blocks.
    other = ids[: 2 * bs] + [t + 1 for t in ids[2 * bs :]]
    assert index.cached_tokens("w", PromptHashes(other)) == 2 * bs
