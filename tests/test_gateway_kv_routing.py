"""Cache-aware routing on hand-set worker states and KV indexes (no servers): a prompt goes
where its prefix is cached unless the work queued there outweighs it; weight 0 (or
``--routing load``) routes by load alone; a worker that leaves takes its entries along."""

from __future__ import annotations

from engine.kv_events import prefix_block_hashes
from gateway.routing.kv_feed import KVFeed
from gateway.routing.kv_index import KVIndex, PromptHashes
from gateway.routing.router import Route, Router, WorkerKind
from protos.baton.v1 import worker_pb2
from rpc.channels import ChannelCache

BS = 16
PROMPT = list(range(1000, 1000 + 10 * BS))  # ten full blocks


def router(*, decode: int = 1, prefill: int = 2, weight: float = 1.0) -> tuple[Router, KVIndex]:
    index = KVIndex()
    channels = ChannelCache()
    r = Router(
        [f"d{i}:1" for i in range(decode)],
        [f"p{i}:1" for i in range(prefill)],
        channels,
        kv_feed=KVFeed(index, channels),
        cache_weight=weight,
    )
    for w in r.workers:
        w.update(worker_pb2.WorkerStats(free_kv_blocks=100))
    return r, index


def cache(index: KVIndex, address: str, blocks: int) -> None:
    stored = prefix_block_hashes(PROMPT, BS)[:blocks]
    index.apply(address, seq=1, snapshot=True, stored=stored, removed=(), block_size=BS)


def queued(r: Router, address: str, tokens: int) -> None:
    w = next(w for w in r.workers if w.address == address)
    w.update(worker_pb2.WorkerStats(free_kv_blocks=100, queued_prompt_tokens=tokens))


def test_the_prompt_goes_where_its_prefix_is_cached() -> None:
    r, index = router()
    cache(index, "p1:1", 8)  # 128 of the 160 tokens
    queued(r, "p1:1", 50)  # a little more load than p0
    assert r.pick(len(PROMPT), prompt=PROMPT).prefill == "p1:1"
    # The work added there is the uncached part only.
    p1 = next(w for w in r.workers if w.address == "p1:1")
    assert p1.prompt_tokens_since_poll == 32
    assert (r.routed_prompt_tokens, r.routed_cached_tokens) == (160, 128)


def test_unless_the_work_queued_there_outweighs_the_cached_part() -> None:
    r, index = router()
    cache(index, "p1:1", 8)
    queued(r, "p1:1", 500)  # 500 + 32 > 0 + 160
    assert r.pick(len(PROMPT), prompt=PROMPT).prefill == "p0:1"


def test_the_longer_cached_prefix_wins_and_ties_go_by_load() -> None:
    r, index = router(prefill=3)
    cache(index, "p0:1", 2)
    cache(index, "p1:1", 6)
    cache(index, "p2:1", 6)
    queued(r, "p1:1", 10)
    assert r.pick(len(PROMPT), prompt=PROMPT).prefill == "p2:1"


def test_weight_zero_and_load_routing_ignore_the_cache() -> None:
    r, index = router(weight=0.0)
    cache(index, "p1:1", 10)
    queued(r, "p1:1", 50)
    assert r.pick(len(PROMPT), prompt=PROMPT).prefill == "p0:1"
    plain = Router(["d0:1"], ["p0:1", "p1:1"], ChannelCache())  # --routing load
    for w in plain.workers:
        w.update(worker_pb2.WorkerStats(free_kv_blocks=100))
    next(w for w in plain.workers if w.address == "p1:1").queued_prompt_tokens = 50
    assert plain.pick(len(PROMPT), prompt=PROMPT).prefill == "p0:1"


def test_single_process_routes_decode_workers_by_their_cache() -> None:
    r, index = router(decode=2, prefill=0)
    cache(index, "d1:1", 9)
    assert r.pick(len(PROMPT), prompt=PROMPT).decode == "d1:1"
    # Without any cached prefix, decode routing is what it always was (free blocks / load).
    r2, _ = router(decode=2, prefill=0)
    next(w for w in r2.workers if w.address == "d0:1").free_kv_blocks = 10
    assert r2.pick(len(PROMPT), prompt=PROMPT).decode == "d1:1"


def test_a_remote_prefill_lands_on_the_decode_worker_holding_the_prefix() -> None:
    """Its prefill worker then sends only the blocks past that prefix. The decode worker
    holding 80 % scores up to 1.8x its load score (free blocks per unit of load): it wins
    against one with somewhat more room, and loses against one with far more."""
    r, index = router(decode=2)
    cache(index, "d1:1", 8)
    d0, d1 = (next(w for w in r.workers if w.address == a) for a in ("d0:1", "d1:1"))
    d0.update(worker_pb2.WorkerStats(free_kv_blocks=100, num_running=1))  # 50
    d1.update(worker_pb2.WorkerStats(free_kv_blocks=70, num_running=1))  # 35 x 1.8 = 63
    assert r.pick(len(PROMPT), prompt=PROMPT).decode == "d1:1"
    d1.update(worker_pb2.WorkerStats(free_kv_blocks=40, num_running=1))  # 20 x 1.8 = 36
    assert r.pick(len(PROMPT), prompt=PROMPT).decode == "d0:1"
    # Without a cache index (load routing) the load alone decides.
    plain = Router(["d0:1", "d1:1"], ["p0:1"], ChannelCache())
    for w in plain.workers:
        w.update(worker_pb2.WorkerStats(free_kv_blocks=100))
    next(w for w in plain.workers if w.address == "d0:1").load = 1
    assert plain.pick(len(PROMPT), prompt=PROMPT).decode == "d1:1"


async def test_a_worker_that_leaves_its_fleet_loses_its_entries() -> None:
    r, index = router()
    cache(index, "p1:1", 8)
    p1 = next(w for w in r.workers if w.address == "p1:1")
    assert p1.kind is WorkerKind.PREFILL
    r._forget(p1)
    assert not index.known("p1:1")
    assert r.pick(len(PROMPT), prompt=PROMPT).prefill == "p0:1"
    await r.close()


def conditional(
    *, tokens: int = 64, fraction: float = 0.8, decode: int = 2
) -> tuple[Router, KVIndex]:
    index = KVIndex()
    channels = ChannelCache()
    r = Router(
        [f"d{i}:1" for i in range(decode)],
        ["p0:1"],
        channels,
        kv_feed=KVFeed(index, channels),
        local_prefill_tokens=tokens,
        local_cached_fraction=fraction,
    )
    for w in r.workers:
        w.update(worker_pb2.WorkerStats(free_kv_blocks=100))
    return r, index


def test_a_short_prompt_is_prefilled_on_the_decode_worker() -> None:
    r, _ = conditional()
    route = r.pick(40, prompt=PROMPT[:40])
    assert route.prefill == "" and route.decode in ("d0:1", "d1:1")
    assert (r.local_prefills, r.remote_prefills) == (1, 0)
    assert r.pick(len(PROMPT), prompt=PROMPT).prefill == "p0:1"  # 160 uncached > 64
    assert (r.local_prefills, r.remote_prefills) == (1, 1)


def test_a_prompt_mostly_held_by_a_decode_worker_stays_there() -> None:
    r, index = conditional(tokens=16)
    cache(index, "d1:1", 8)  # 128 of 160 = 0.8, 32 uncached > 16
    route = r.pick(len(PROMPT), prompt=PROMPT)
    assert route == Route(decode="d1:1", prefill="")
    r2, index2 = conditional(tokens=16)
    cache(index2, "d1:1", 7)  # 0.7: not enough
    assert r2.pick(len(PROMPT), prompt=PROMPT).prefill == "p0:1"


def test_a_decode_worker_busy_with_prompts_sends_the_next_one_to_prefill() -> None:
    r, _ = conditional(tokens=64, decode=1)
    assert r.pick(40, prompt=PROMPT[:40]).prefill == ""
    # 40 queued there now (this gateway's pick); 40 more would pass 64.
    assert r.pick(40, prompt=PROMPT[40:80]).prefill == "p0:1"
    d0 = next(w for w in r.workers if w.address == "d0:1")
    d0.update(worker_pb2.WorkerStats(free_kv_blocks=100))  # its report: nothing queued
    assert r.pick(40, prompt=PROMPT[80:120]).prefill == ""


def test_zero_local_tokens_turns_conditional_disaggregation_off() -> None:
    r, index = conditional(tokens=0)
    cache(index, "d0:1", 10)
    assert r.pick(len(PROMPT), prompt=PROMPT).prefill == "p0:1"
    assert r.pick(3, prompt=PROMPT[:3]).prefill == "p0:1"


# -- what the gateway just sent: expected blocks ------------------------------------------

SYSTEM = list(range(5000, 5000 + 8 * BS))  # a new shared system prompt: eight blocks


def turn(i: int) -> list[int]:
    return SYSTEM + list(range(9000 + 100 * i, 9000 + 100 * i + 40))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def burst_router(clock: Clock, **kw: object) -> tuple[Router, KVIndex]:
    index = KVIndex(clock=clock, expect_ttl_s=30.0, **kw)  # type: ignore[arg-type]
    channels = ChannelCache()
    r = Router(["d0:1"], ["p0:1", "p1:1"], channels, kv_feed=KVFeed(index, channels))
    for w in r.workers:
        w.update(worker_pb2.WorkerStats(free_kv_blocks=100))
        index.apply(w.address, seq=1, snapshot=True, stored=(), removed=(), block_size=BS)
    return r, index


def test_a_burst_sharing_a_new_prefix_lines_up_behind_the_first_one() -> None:
    """Nothing holds the system prompt yet; the first turn goes by load, and the next ones,
    sent before any event says it is computed, follow it there (at the default weight a
    held or expected prefix outweighs that much more queue) instead of each computing it
    again on the other worker."""
    clock = Clock()
    r, index = burst_router(clock)
    first = r.pick(len(turn(0)), prompt=turn(0)).prefill
    assert index.num_expected(first) == 10  # the 168-token turn's full blocks
    for i in (1, 2, 3):
        assert r.pick(len(turn(i)), prompt=turn(i)).prefill == first
    # The computing worker's events confirm them: no longer merely expected.
    hashes = PromptHashes(turn(0)).of(BS)
    index.apply(first, seq=2, snapshot=False, stored=hashes, removed=(), block_size=BS)
    assert index.cached_tokens(first, PromptHashes(turn(5))) == 8 * BS
    assert index.num_expected(first) == 3 * 2  # turns 1-3's own blocks past the system


def test_an_expectation_no_event_confirms_expires() -> None:
    clock = Clock()
    r, index = burst_router(clock)
    first = r.pick(len(turn(0)), prompt=turn(0)).prefill
    other = "p1:1" if first == "p0:1" else "p0:1"
    clock.now += 31.0  # the prompt failed, or its blocks were evicted at once
    assert index.cached_tokens(first, PromptHashes(turn(1))) == 0
    # By load again (the first worker still has its pick counted).
    assert r.pick(len(turn(1)), prompt=turn(1)).prefill == other


def test_expectations_are_bounded_per_worker_oldest_first() -> None:
    clock = Clock()
    index = KVIndex(clock=clock, max_expected=12)
    index.apply("p0:1", seq=1, snapshot=True, stored=(), removed=(), block_size=BS)
    index.expect("p0:1", PromptHashes(turn(0)))  # 10 blocks
    clock.now += 1
    index.expect("p0:1", PromptHashes(list(range(20000, 20000 + 4 * BS))))  # 4 more
    assert index.num_expected("p0:1") == 12
    assert index.cached_tokens("p0:1", PromptHashes(turn(0))) == 0  # its head went first
    # A worker whose events have not begun (block size unknown) gets none.
    index.expect("p9:1", PromptHashes(turn(0)))
    assert index.num_expected("p9:1") == 0 and not index.known("p9:1")


def test_local_prefill_counts_only_what_the_decode_worker_holds_now() -> None:
    """A prefix merely on its way to a decode worker would be computed again there by a
    local prefill: the remote path keeps the follower, which the prefill worker computing
    (or holding) the prefix serves."""
    r, index = conditional(tokens=64, fraction=0.8, decode=1)
    index.apply("d0:1", seq=1, snapshot=True, stored=(), removed=(), block_size=BS)
    index.apply("p0:1", seq=1, snapshot=True, stored=(), removed=(), block_size=BS)
    assert r.pick(len(turn(0)), prompt=turn(0)).prefill == "p0:1"
    assert index.cached_tokens("d0:1", PromptHashes(turn(1))) == 8 * BS  # expected there
    assert r.pick(len(turn(1)), prompt=turn(1)).prefill == "p0:1"
    hashes = PromptHashes(turn(0)).of(BS)
    index.apply("d0:1", seq=2, snapshot=False, stored=hashes, removed=(), block_size=BS)
    d0 = next(w for w in r.workers if w.address == "d0:1")
    d0.update(worker_pb2.WorkerStats(free_kv_blocks=100))
    assert r.pick(len(turn(2)), prompt=turn(2)).prefill == ""  # held now: local
