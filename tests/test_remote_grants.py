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
