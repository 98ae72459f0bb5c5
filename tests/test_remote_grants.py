"""Blocks leased to remote writers: never ones an in-flight step still writes, and a
lease's block generation is checked when its KV is declared ready."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.errors import AbortedError, ResourceExhaustedError
from engine.scheduler import SampledToken
from tests.fake_runner import make_request, make_scheduler


def _written(sched_out, block_size: int) -> set[int]:  # noqa: ANN001
    return {
        b
        for seq in sched_out.seqs
        for b in seq.block_ids[
            seq.start // block_size : -(-(seq.start + seq.num_new) // block_size)
        ]
    }


def test_blocks_freed_during_a_step_are_not_leased_until_it_is_applied() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=32)
    sched.add(make_request("a", list(range(10, 30)), max_tokens=4))  # 20 tokens: 5 blocks
    step = sched.schedule()  # in flight: it writes a's five blocks
    written = _written(step, 4)
    assert len(written) == 5
    sched.abort("a")  # a client cancel while the step computes
    assert sched.pool.num_free == 8
    # A remote writer gets only the three blocks no step is writing...
    b = sched.reserve_remote(make_request("b", list(range(40, 52))))  # 3 blocks
    assert not set(b) & written
    with pytest.raises(ResourceExhaustedError, match="still written by a step in flight"):
        sched.reserve_remote(make_request("c", list(range(60, 64))))
    # ...and the rest once the step's results are applied.
    sched.update(step, [SampledToken(1) if s.sample else None for s in step.seqs])
    c = sched.reserve_remote(make_request("c", list(range(60, 64))))
    assert set(c) <= written


def test_local_steps_may_reuse_blocks_freed_during_a_step() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=32)
    sched.add(make_request("a", list(range(10, 30)), max_tokens=4))
    first = sched.schedule()
    sched.abort("a")
    sched.add(make_request("b", list(range(40, 60)), max_tokens=4))
    second = sched.schedule()  # runs after the first, in order: safe to reuse
    assert _written(second, 4) & _written(first, 4)


def test_kv_ready_refuses_blocks_reallocated_since_the_lease() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    r = make_request("r", list(range(10, 22)))
    blocks = sched.reserve_remote(r)
    lease_generation = sched.pool.generation(blocks)
    # A bug frees and reallocates the leased blocks behind the lease's back.
    sched.pool.free(blocks)
    assert sched.pool.allocate(8) is not None
    with pytest.raises(AbortedError, match="reallocated after the lease"):
        sched.remote_kv_ready("r", 5, lease_generation)
    assert "r" in sched.remote  # nothing changed; the caller aborts the request


def test_kv_ready_with_the_lease_generation_runs() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    blocks = sched.reserve_remote(make_request("r", list(range(10, 22))))
    assert sched.remote_kv_ready("r", 5, sched.pool.generation(blocks)) is None
    assert [r.request_id for r in sched.running] == ["r"]


def test_generation_changes_with_any_reallocation() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    assert blocks is not None
    g = pool.generation(blocks)
    assert g == pool.generation(list(blocks)) and g > 0
    pool.free([blocks[1]])
    assert pool.generation(blocks) == g  # freeing alone changes nothing
    again = pool.allocate(1, avoid=frozenset({2, 3}))
    assert again == [blocks[1]] and pool.generation(blocks) != g


def test_allocate_skips_avoided_blocks_and_keeps_their_lru_place() -> None:
    pool = BlockPool(5, 4)
    assert pool.allocate(2, avoid=frozenset({0, 2})) == [1, 3]
    assert pool.allocate(3, avoid=frozenset({0, 2})) is None
    assert pool.allocate(3) == [0, 2, 4]


# -- a remote prefill over a prefix this engine holds ------------------------------------


def _cache_prompt(sched, tokens: list[int]) -> None:  # noqa: ANN001
    """Run ``tokens`` here to the end, so its full blocks sit in the prefix cache."""
    sched.add(make_request("earlier", tokens, max_tokens=1))
    while sched.has_work():
        step = sched.schedule()
        sched.update(step, [SampledToken(1) if s.sample else None for s in step.seqs])


def test_a_remote_grant_shares_the_cached_prefix_and_leases_only_the_rest() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    history = list(range(10, 30))  # 5 full blocks
    _cache_prompt(sched, history)
    cached = sched.pool.match_prefix(
        sched._hashes_upto(make_request("x", history), 5),
        [tuple(history[b * 4 : (b + 1) * 4]) for b in range(5)],
    )
    assert len(cached) == 5
    follow_up = make_request("r", history + list(range(40, 46)))  # 26 tokens: 7 blocks
    blocks = sched.reserve_remote(follow_up)
    assert len(blocks) == 7 and blocks[:5] == cached
    assert follow_up.num_reused_blocks == 5
    assert all(sched.pool.ref_count(b) == 1 for b in blocks)
    # The lease covers the two written blocks; kv_ready checks those and runs the request.
    assert sched.remote_kv_ready("r", 7, sched.pool.generation(blocks[5:])) is None
    assert [r.request_id for r in sched.running] == ["r"]
    # Abort frees what it holds: the shared prefix stays cached, the pool is whole again.
    sched.abort("r")
    assert sched.pool.num_free == 16
    assert len(sched.pool.match_prefix(
        sched._hashes_upto(make_request("y", history), 5),
        [tuple(history[b * 4 : (b + 1) * 4]) for b in range(5)],
    )) == 5  # fmt: skip


def test_a_remote_grant_always_leaves_the_last_prompt_block_to_the_sender() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    history = list(range(10, 30))
    _cache_prompt(sched, history)
    # The same 20 tokens again: 5 full cached blocks, but the block of the last token is
    # leased (the prefill worker samples the first token from it).
    again = make_request("r", history)
    blocks = sched.reserve_remote(again)
    assert len(blocks) == 5 and again.num_reused_blocks == 4
    # A prompt that diverges inside the first block reuses nothing.
    other = make_request("o", [99, *history[1:]])
    assert sched.reserve_remote(other) and other.num_reused_blocks == 0


def test_a_remote_grant_reuses_nothing_without_prefix_caching() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, enable_prefix_caching=False)
    history = list(range(10, 30))
    _cache_prompt(sched, history)
    r = make_request("r", history + [1, 2])
    assert len(sched.reserve_remote(r)) == 6 and r.num_reused_blocks == 0


def test_a_follow_up_whose_history_a_running_turn_holds_needs_only_its_new_blocks() -> None:
    # 12 blocks; the first turn holds 7 (its 20-token history is 5 full, shared-able ones).
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=64)
    history = list(range(10, 30))
    first = make_request("first", history + list(range(40, 46)), max_tokens=8)
    blocks = sched.reserve_remote(first)
    assert sched.remote_kv_ready("first", 7, sched.pool.generation(blocks)) is None
    assert sched.pool.num_free == 5
    # A follow-up on the same history needs 7 blocks for its 26 tokens, but 5 of them are
    # the first turn's: it takes 2 from the free list and is granted at once.
    follow_up = make_request("follow-up", history + list(range(50, 56)))
    got = sched.reserve_remote(follow_up)
    assert got[:5] == blocks[:5] and follow_up.num_reused_blocks == 5
    assert sched.pool.num_free == 3
    # Cached blocks nobody holds still count against the free list: once both turns end
    # they are free again, and a prompt that needs more than the pool is still refused.
    sched.abort("first")
    sched.abort("follow-up")
    assert sched.pool.num_free == 12
    too_big = make_request("too-big", history + list(range(60, 90)))  # 50 tokens: 13 blocks
    with pytest.raises(ValueError, match="KV blocks"):
        sched.reserve_remote(too_big)


def test_a_follow_up_on_cached_but_unheld_history_counts_those_blocks() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    history = list(range(10, 30))  # 5 full blocks, cached once "earlier" ends
    _cache_prompt(sched, history)
    hog = sched.reserve_remote(make_request("hog", list(range(100, 108))))  # 2 blocks
    assert len(hog) == 2 and sched.pool.num_free == 6
    # 26 tokens: 5 cached blocks nobody holds (each revived out of the free list) + 2
    # fresh = 7 > 6 free: refused, and nothing was taken.
    with pytest.raises(ResourceExhaustedError, match=r"7 needed, 6 free"):
        sched.reserve_remote(make_request("r", history + list(range(40, 46))))
    assert sched.pool.num_free == 6
