"""A torch-free stand-in for the model runner, and drivers that run a Scheduler with it.

``FakeRunner`` keeps a token-level KV cache: each step writes, into the slots the block
table names, every fed token together with a digest of the whole prefix up to it (real KV
depends on everything before it, too). It then "samples" the next token as a pure function
of the context it reads back through the block table, after checking that the digest read
back matches that context: a block computed after another prefix (a bad prefix-cache hit)
fails loudly. A wrong block table or a lost write changes the output, and
``reference_output`` (which never touches a scheduler) says what every request must produce.

The drivers call ``schedule`` -> ``execute`` -> ``update`` either strictly or overlapped
like the engine thread (step N+1 is scheduled, and executed, before step N's update), and
apply scripted events (abort, release of held blocks, remote KV arrival) before a
``schedule`` call, which is where the engine thread drains its commands.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.request import FinishReason, Request, RequestOutput, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import PENDING_TOKEN, SampledToken, Scheduler, SchedulerOutput

VOCAB = 1000

# The fake model: next token id as a function of the whole context.
NextToken = Callable[[Sequence[int]], int]


def context_token(context: Sequence[int]) -> int:
    """Deterministic across processes (no str hashing), depends on every context token."""
    return zlib.crc32(repr(tuple(context)).encode()) % VOCAB


def prefix_digest(tokens: Sequence[int], start: int = 0) -> int:
    """Running digest of a token prefix; ``start`` is the digest of what came before."""
    return zlib.crc32(b"".join(t.to_bytes(4, "little") for t in tokens), start)


def sample(
    next_token: NextToken,
    context: Sequence[int],
    num_outputs: int,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
) -> int:
    """The model's token, with stop tokens masked while fewer than min_tokens exist (as the
    real sampler does)."""
    tok = next_token(context)
    if num_outputs < params.min_tokens:
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= eos_token_ids
        while tok in banned:
            tok = (tok + 1) % VOCAB
    return tok


def reference_output(
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    max_model_len: int,
    eos_token_ids: frozenset[int] = frozenset(),
    next_token: NextToken = context_token,
) -> tuple[list[int], FinishReason]:
    """What a request must produce, computed one token at a time with no scheduler."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        tok = sample(next_token, tokens, len(out), params, eos_token_ids)
        out.append(tok)
        tokens.append(tok)
        n = len(out)
        if n > params.min_tokens and (
            (not params.ignore_eos and tok in eos_token_ids) or tok in params.stop_token_ids
        ):
            return out, FinishReason.STOP
        if n >= params.max_tokens or len(tokens) >= max_model_len:
            return out, FinishReason.LENGTH


class FakeRunner:
    """Executes a SchedulerOutput against a token-level KV cache.

    Like the real runner, it resolves a PENDING input token from the previous ``execute``
    call's samples, so calls must come in step order.
    """

    def __init__(self, pool: BlockPool, *, next_token: NextToken = context_token):
        self.pool = pool
        self.block_size = pool.block_size
        # Per slot: (token id, digest of the prefix ending with it), None until written.
        self.kv: list[list[tuple[int, int] | None]] = [
            [None] * pool.block_size for _ in range(pool.num_blocks)
        ]
        self.next_token = next_token
        self._last_sampled: dict[str, int] = {}
        self.num_steps = 0

    def _slot(self, block_ids: Sequence[int], pos: int) -> tuple[int, int]:
        entry = self.kv[block_ids[pos // self.block_size]][pos % self.block_size]
        assert entry is not None, f"position {pos} read before it was written"
        return entry

    def write(self, block_ids: Sequence[int], start: int, token_ids: Sequence[int]) -> None:
        """Like attention: each position's KV depends on the KV already in place before it."""
        bs = self.block_size
        digest = self._slot(block_ids, start - 1)[1] if start else 0
        for k, tok in enumerate(token_ids):
            pos = start + k
            digest = prefix_digest([tok], digest)
            self.kv[block_ids[pos // bs]][pos % bs] = (tok, digest)

    def read(self, block_ids: Sequence[int], end: int) -> list[int]:
        """The context [0, end), checked against the digest stored with its last token."""
        tokens = [self._slot(block_ids, pos)[0] for pos in range(end)]
        assert self._slot(block_ids, end - 1)[1] == prefix_digest(tokens), (
            f"KV of {tokens} was computed after another prefix (block table {list(block_ids)})"
        )
        return tokens

    def execute(self, sched: SchedulerOutput) -> list[SampledToken | None]:
        bs = self.block_size
        for s in sched.seqs:
            end = s.start + s.num_new
            assert len(s.input_ids) == s.num_new
            assert len(s.block_ids) == -(-end // bs), "block table must cover [0, end)"
            assert len(set(s.block_ids)) == len(s.block_ids), "a block appears twice in a table"
            for b in range(s.start // bs, -(-end // bs)):
                # Writing into a block another sequence also references would corrupt it.
                assert self.pool.ref_count(s.block_ids[b]) == 1, (
                    f"{s.request.request_id} writes shared/free block {s.block_ids[b]}"
                )
            ids = list(s.input_ids)
            if ids[-1] == PENDING_TOKEN:
                ids[-1] = self._last_sampled[s.request.request_id]
            assert PENDING_TOKEN not in ids
            self.write(s.block_ids, s.start, ids)
        results: list[SampledToken | None] = []
        last: dict[str, int] = {}
        for s in sched.seqs:
            if not s.sample:
                results.append(None)
                continue
            req = s.request
            end = s.start + s.num_new
            context = self.read(s.block_ids, end)
            tok = sample(
                self.next_token, context, end - req.num_prompt_tokens, req.params, req.eos_token_ids
            )
            last[req.request_id] = tok
            results.append(SampledToken(tok))
        self._last_sampled = last
        self.num_steps += 1
        return results


def make_request(
    rid: str,
    prompt: Sequence[int],
    *,
    max_tokens: int = 8,
    hold_kv: bool = False,
    eos: Sequence[int] = (),
    **params: object,
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=frozenset(eos),
        hold_kv=hold_kv,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 128,
    enable_prefix_caching: bool = True,
    max_queued: int = 256,
    growth_tokens: int = 0,
    max_prefill_while_decoding: int = 0,
) -> Scheduler:
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(
        pool,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        max_queued=max_queued,
        growth_tokens=growth_tokens,
        max_prefill_while_decoding=max_prefill_while_decoding,
    )


def check_accounting(sched: Scheduler) -> None:
    """Every block reference is owned by exactly one live request or held entry."""
    pool = sched.pool
    expected = [0] * pool.num_blocks
    owners = [r.block_ids for r in sched.requests.values()] + list(sched.held.values())
    for blocks in owners:
        for b in blocks:
            expected[b] += 1
    actual = [pool.ref_count(b) for b in range(pool.num_blocks)]
    assert actual == expected, f"ref counts {actual} != references held {expected}"
    assert pool.num_free == actual.count(0)
    assert pool.num_free + pool.num_used == pool.num_blocks
    for r in sched.requests.values():
        assert not r.is_finished
        if r.status is RequestStatus.WAITING and r.block_ids:
            # Only requests whose KV arrived from a prefill worker wait with blocks.
            assert r.num_computed_tokens >= r.num_prompt_tokens


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Per-step limits: token budget, sequence cap, and consistent batch bookkeeping."""
    assert out.num_batched_tokens == sum(s.num_new for s in out.seqs)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert len(out.seqs) <= sched.max_num_seqs
    ids = [s.request.request_id for s in out.seqs]
    assert len(ids) == len(set(ids)), f"a request scheduled twice in one step: {ids}"
    for s in out.seqs:
        assert s.num_new >= 1
        assert s.start + s.num_new <= sched.max_model_len
        assert s.request.status is RequestStatus.RUNNING
        assert s.request.request_id not in out.preempted_ids


# A scripted event, applied before a given schedule call.
Event = Callable[["Driver"], None]

# Before a schedule call, each running request: (id, computed, logical length, wants more).
RunningSnapshot = list[tuple[str, int, int, bool]]
StepCheck = Callable[[Scheduler, SchedulerOutput, RunningSnapshot], None]


@dataclass
class Driver:
    """Runs a scheduler to completion with a FakeRunner, strictly or overlapped.

    ``events[t]`` run before the t-th schedule call (counting from 0, empty ticks too).
    A held request named in ``release_after`` is released that many ticks after it finished.
    """

    sched: Scheduler
    runner: FakeRunner
    overlapped: bool = False
    events: dict[int, list[Event]] = field(default_factory=dict)
    release_after: dict[str, int] = field(default_factory=dict)
    on_step: StepCheck | None = None
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    held: dict[str, list[int]] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    num_schedules: int = 0
    kv_delay: dict[str, int] = field(default_factory=dict)  # queued reservations
    granted_at: dict[str, int] = field(default_factory=dict)  # rid -> tick of the grant

    @classmethod
    def build(cls, sched: Scheduler, **kwargs: object) -> Driver:
        return cls(sched, FakeRunner(sched.pool), **kwargs)  # type: ignore[arg-type]

    # -- events --

    def at(self, tick: int, event: Event) -> None:
        self.events.setdefault(tick, []).append(event)

    def add_at(self, tick: int, req: Request) -> None:
        self.at(tick, lambda d: d.add(req))

    def abort_at(self, tick: int, rid: str) -> None:
        self.at(tick, lambda d: d.abort(rid))

    def release_at(self, tick: int, rid: str) -> None:
        self.at(tick, lambda d: d.release(rid))

    def reserve_at(self, tick: int, req: Request, kv_delay: int) -> None:
        self.at(tick, lambda d: d.reserve(req, kv_delay))

    def add(self, req: Request) -> None:
        self.sched.add(req)

    def abort(self, rid: str) -> None:
        self.collect([self.sched.abort(rid)])

    def release(self, rid: str) -> None:
        self.sched.release_held(rid)

    def reserve(self, req: Request, kv_delay: int) -> None:
        """Reserve blocks for ``req``'s remote KV, queueing in the reservation FIFO while
        the pool is full (as the engine does); the KV arrives ``kv_delay`` ticks after
        the blocks were granted."""
        self.kv_delay[req.request_id] = kv_delay
        if self.sched.queue_remote(req) is not None:
            self._granted(req)

    def _granted(self, req: Request) -> None:
        delay = self.kv_delay.pop(req.request_id)
        self.granted_at[req.request_id] = self.num_schedules
        self.at(self.num_schedules + delay, lambda d: d.kv_arrives(req.request_id))

    def kv_arrives(self, rid: str) -> None:
        """A prefill worker filled ``rid``'s reserved blocks and sampled its first token."""
        req = self.sched.remote.get(rid)
        if req is None:
            return
        self.runner.write(req.block_ids, 0, req.prompt_token_ids)
        first = sample(
            self.runner.next_token, req.prompt_token_ids, 0, req.params, req.eos_token_ids
        )
        self.tokens.setdefault(rid, []).append(first)  # the prefill worker streamed it
        self.collect([self.sched.remote_kv_ready(rid, first)])

    def collect(self, outputs: Sequence[RequestOutput | None]) -> None:
        for o in outputs:
            if o is None:
                continue
            assert o.request_id not in self.finish, f"output after finish for {o.request_id}"
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason
                if o.held_block_ids is not None:
                    self.held[o.request_id] = o.held_block_ids
                    delay = self.release_after.get(o.request_id)
                    if delay is not None:
                        self.release_at(self.num_schedules + delay, o.request_id)

    # -- the loop --

    def _schedule(self) -> SchedulerOutput | None:
        while self.num_schedules in self.events:  # events may add events for this tick
            for event in self.events.pop(self.num_schedules):
                event(self)
        for req in self.sched.grant_reserved():  # as the engine loop does between steps
            self._granted(req)
        self.num_schedules += 1
        check_accounting(self.sched)
        if not self.sched.has_work():
            return None
        before = [
            (r.request_id, r.num_computed_tokens, r.num_tokens + r.num_pending_tokens,
             r.wants_more_tokens)
            for r in self.sched.running
        ]
        out = self.sched.schedule()
        check_step(self.sched, out)
        check_accounting(self.sched)
        if self.on_step is not None:
            self.on_step(self.sched, out, before)
        if out.empty:
            return None
        self.steps.append(out)
        return out

    def _update(self, out: SchedulerOutput, results: list[SampledToken | None]) -> None:
        self.collect(self.sched.update(out, results))
        check_accounting(self.sched)

    def run_ticks(self, n: int) -> Driver:
        """``n`` schedule calls, each step applied before the next (not overlapped)."""
        for _ in range(n):
            out = self._schedule()
            if out is not None:
                self._update(out, self.runner.execute(out))
        return self

    def run(self, max_ticks: int = 3000) -> Driver:
        """Until no work, no pending event and nothing in flight; fails on a stall."""
        inflight: tuple[SchedulerOutput, list[SampledToken | None]] | None = None
        while (
            self.sched.has_work()
            or self.events
            or inflight is not None
            or self.sched.remote
            or self.sched.reserving
        ):
            assert self.num_schedules < max_ticks, (
                f"no completion after {max_ticks} schedule calls: "
                f"waiting={[r.request_id for r in self.sched.waiting]} "
                f"running={[r.request_id for r in self.sched.running]} "
                f"remote={list(self.sched.remote)} "
                f"reserving={[r.request_id for r in self.sched.reserving]} "
                f"free={self.sched.pool.num_free}/{self.sched.pool.num_blocks}"
            )
            out = self._schedule()
            nxt = (out, self.runner.execute(out)) if out is not None else None
            if self.overlapped:
                if inflight is not None:
                    self._update(*inflight)
                inflight = nxt
            elif nxt is not None:
                self._update(*nxt)
        return self
