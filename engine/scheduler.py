"""Iteration-level continuous batching over a token budget and a sequence cap. Torch-free.

Each step, running requests go first (decode tokens and the rest of chunked prefills),
then waiting requests are admitted FCFS while the token budget, the sequence cap and
free blocks allow. When a running request needs a block and none is free, the newest
running request is preempted by recompute. Progress is ``num_computed_tokens`` against
the request's logical length, so a prompt chunk, a decode token, a prefix-cache hit, a
recompute after preemption and KV that arrived from a prefill worker are one idea.

Admission (every queue has a bound; overflow is ResourceExhaustedError, RESOURCE_EXHAUSTED
on the wire): new local requests wait in ``waiting`` (at most ``max_queued``); requests
whose KV a prefill worker will write wait for their blocks in the reservation FIFO
``reserving`` (at most ``max_queued``), served in order as blocks free up
(``grant_reserved``). A reservation is granted only while no preempted request waits
(those go first) and only if it leaves free the blocks every admitted request needs for
its next ``growth_tokens`` tokens (``growth_blocks``, the watermark), so new arrivals do
not push admitted requests into recompute.

``schedule`` may run while the previous step is still executing: a token sampled by
that step is *pending* (counted, id not yet known); the runner fills it in. Blocks a
step writes stay off-limits to remote writers until that step's results are applied:
a block freed meanwhile (an abort, a preemption) could otherwise be leased to a prefill
worker whose copy the in-flight step then overwrites. Local steps may reuse such blocks
at once, since they run after it, in order.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import NO_PARENT, ROOT_HASH, BlockPool, hash_block
from engine.errors import AbortedError, ResourceExhaustedError
from engine.request import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    RequestTimings,
    TokenLogprob,
)

logger = logging.getLogger(__name__)

PENDING_TOKEN = -1


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: compute ``num_new`` tokens starting at ``start``."""

    request: Request
    start: int
    num_new: int
    # Sample a token after this step (the step reaches the request's logical end).
    sample: bool
    # Token ids to feed; the last is PENDING_TOKEN when it is the previous step's sample.
    input_ids: list[int]
    # Blocks covering positions [0, start + num_new).
    block_ids: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(slots=True)
class SampledToken:
    """What the runner sampled for one ``ScheduledSeq`` with ``sample=True``."""

    token_id: int
    logprob: TokenLogprob | None = None


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_queued: int = 256,
        growth_tokens: int = 0,
        max_prefill_while_decoding: int = 0,
    ):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        if growth_tokens < 0:
            raise ValueError(f"growth_tokens must be >= 0, got {growth_tokens}")
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # A sequence can never outgrow the pool: past it, it would preempt itself forever.
        self.max_seq_len = min(max_model_len, pool.num_blocks * pool.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # blocks reserved, KV not yet arrived
        # Remote-KV requests waiting, in arrival order, for blocks to be reserved.
        self.reserving: deque[Request] = deque()
        self.max_queued = max_queued
        # A reservation must leave free the blocks every admitted request needs for its
        # next ``growth_tokens`` tokens (capped by its max_tokens): the watermark.
        self.growth_tokens = growth_tokens
        # Prompt tokens a step that also decodes may carry (0: only the step budget).
        self.max_prefill_while_decoding = max_prefill_while_decoding
        self.held: dict[str, list[int]] = {}  # finished, blocks kept for a transfer
        self._step_id = 0
        self.num_preemptions = 0
        # step id -> blocks that step writes, from schedule() until update() of it.
        self._writing: dict[int, frozenset[int]] = {}
        # Since start: prompt tokens of admitted requests (run here or reserved for KV from
        # a prefill worker) and tokens sampled; the metrics' prompt / generation counters.
        self.num_prompt_tokens_total = 0
        self.num_generated_tokens_total = 0

    # -- intake -----------------------------------------------------------------------

    def check_admissible(self, request_id: str, prompt_len: int) -> None:
        """Raise ValueError for a request that could never run (nothing is allocated)."""
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_len < 1:
            raise ValueError("prompt must contain at least one token")
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one new token"
            )
        if prompt_len >= self.max_seq_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens and needs {self._blocks_for(prompt_len + 1)} "
                f"KV blocks; the pool has only {self.pool.num_blocks}"
            )

    def add(self, req: Request) -> None:
        """Queue a request whose prompt this engine computes. Raises ResourceExhaustedError
        (nothing queued) when ``max_queued`` requests wait already."""
        self.check_admissible(req.request_id, req.num_prompt_tokens)
        if len(self.waiting) >= self.max_queued:
            raise ResourceExhaustedError(
                f"request {req.request_id}: the engine queue is full "
                f"({len(self.waiting)} waiting, max_queued_requests={self.max_queued})"
            )
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.num_prompt_tokens_total += req.num_prompt_tokens

    def reserve_remote(self, req: Request) -> list[int]:
        """Allocate blocks for ``req``'s prompt, to be filled by a prefill worker, now.

        Raises ResourceExhaustedError (allocating and queueing nothing) when it cannot be
        granted at once: see ``queue_remote`` for the waiting kind.
        """
        self.check_admissible(req.request_id, req.num_prompt_tokens)
        refusal = self._refusal(req) or self._queue_ahead(req)
        if refusal is not None:
            raise ResourceExhaustedError(refusal)
        return self._grant(req)

    def queue_remote(self, req: Request) -> list[int] | None:
        """Like ``reserve_remote``, but a request that cannot be granted now joins the
        reservation FIFO (returns None); ``grant_reserved`` grants it later, or ``abort``
        drops it. Raises ResourceExhaustedError (nothing queued) when the FIFO is full."""
        self.check_admissible(req.request_id, req.num_prompt_tokens)
        if self._queue_ahead(req) is None and self._refusal(req) is None:
            return self._grant(req)
        if len(self.reserving) >= self.max_queued:
            raise ResourceExhaustedError(
                f"request {req.request_id}: the KV reservation queue is full "
                f"({len(self.reserving)} waiting, max_queued_requests={self.max_queued})"
            )
        req.status = RequestStatus.RESERVING
        self.requests[req.request_id] = req
        self.reserving.append(req)
        return None

    def grant_reserved(self) -> list[Request]:
        """Grant queued reservations from the head of the FIFO while the pool allows;
        returns them (each now WAITING_FOR_KV with its ``block_ids``). Never skips the
        head: a large request at the head is not overtaken by smaller ones behind it."""
        granted: list[Request] = []
        while self.reserving and self._refusal(self.reserving[0]) is None:
            req = self.reserving.popleft()
            self._grant(req)
            granted.append(req)
        return granted

    def _queue_ahead(self, req: Request) -> str | None:
        if self.reserving:
            return (
                f"no KV blocks for request {req.request_id} now: "
                f"{len(self.reserving)} reservation(s) wait ahead of it"
            )
        return None

    def _refusal(self, req: Request) -> str | None:
        """Why ``req``'s reservation cannot be granted now; None if it can."""
        rid = req.request_id
        if self.waiting and self.waiting[0].num_preemptions:
            preempted = sum(1 for r in self.waiting if r.num_preemptions)
            return f"no KV blocks for request {rid} now: {preempted} preempted request(s) go first"
        # A reservation is a promise of a seat in the running batch once the KV arrives.
        admitted = len(self.running) + len(self.remote)
        if admitted >= self.max_num_seqs:
            return f"no free sequence slot for request {rid} (max_num_seqs={self.max_num_seqs})"
        # Leading blocks another request holds are shared, not taken from the free list
        # (cached blocks nobody holds are in it, and sharing revives them): counting them
        # as fresh refused or queued a follow-up turn whose history a running turn holds.
        live = sum(1 for b in self._match_prefix(req) if self.pool.ref_count(b) > 0)
        need = self._blocks_for(req.num_prompt_tokens) - live
        in_flight = frozenset().union(*self._writing.values())
        settling = sum(1 for b in in_flight if self.pool.ref_count(b) == 0)
        free = self.pool.num_free
        # Its own growth counts too, unless nothing is admitted: then there is nothing to
        # protect and a lone request may take the whole pool.
        keep = self.growth_blocks() + self._growth_of(req) if admitted else 0
        if need > free - settling or need + keep > free:
            return (
                f"no free KV blocks for request {rid} ({need} needed, {free} free"
                + (f", {settling} of them still written by a step in flight" if settling else "")
                + (f", {keep} kept for the growth of admitted requests" if keep else "")
                + ")"
            )
        return None

    def growth_blocks(self) -> int:
        """Blocks the admitted requests (running, and waiting for their KV) need for their
        next ``growth_tokens`` tokens each (capped by their max_tokens), beyond what they
        hold: the free-block watermark a new reservation must leave, besides its own
        growth."""
        if not self.growth_tokens:
            return 0
        return sum(self._growth_of(r) for r in (*self.running, *self.remote.values()))

    def _growth_of(self, r: Request) -> int:
        if not self.growth_tokens:
            return 0
        held = len(r.block_ids) or self._blocks_for(r.num_prompt_tokens)
        end = max(self._logical_len(r), r.num_prompt_tokens) + self.growth_tokens
        limit = min(r.num_prompt_tokens + r.params.max_tokens, self.max_seq_len)
        return max(0, self._blocks_for(min(end, limit)) - held)

    def _grant(self, req: Request) -> list[int]:
        """Blocks for the whole prompt: the leading ones this engine's prefix cache holds
        (shared, ``req.num_reused_blocks`` of them: the prefill worker need not send
        them), then fresh ones for the rest. ``_refusal`` counted every block that does not
        come from another request's hold, so the allocation cannot fail."""
        in_flight = frozenset().union(*self._writing.values())
        hits = self._match_prefix(req)
        self.pool.share(hits)
        fresh = self.pool.allocate(
            self._blocks_for(req.num_prompt_tokens) - len(hits), avoid=in_flight
        )
        assert fresh is not None, "_refusal checked the pool"
        blocks = hits + fresh
        req.block_ids = blocks
        req.num_reused_blocks = req.num_registered_blocks = len(hits)
        req.status = RequestStatus.WAITING_FOR_KV
        self.requests[req.request_id] = req
        self.remote[req.request_id] = req
        self.num_prompt_tokens_total += req.num_prompt_tokens
        return blocks

    def remote_kv_ready(
        self, request_id: str, first_token: int, generation: int | None = None
    ) -> RequestOutput | None:
        """The prompt's KV is in place and the prefill worker sampled ``first_token``.

        ``generation`` is what ``pool.generation`` gave for the blocks at reservation; if
        the blocks have been reallocated since, their KV is not this request's and
        AbortedError is raised (nothing changes). Returns a finishing output if the
        first token already ends the request, else None (it joins the next step).
        """
        req = self.remote.get(request_id)
        if req is None:
            return None
        leased = req.block_ids[req.num_reused_blocks :]
        if generation is not None and self.pool.generation(leased) != generation:
            raise AbortedError(
                f"request {request_id}: its KV blocks were reallocated after the lease "
                f"(block generation {self.pool.generation(leased):#x}, lease "
                f"{generation:#x}); the arrived KV is stale"
            )
        del self.remote[request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        self._register_full_blocks(req, req.num_prompt_tokens)
        req.all_token_ids.append(first_token)
        reason = self._stop_reason(req, first_token)
        if reason is not None:
            self._finish(req, reason)
            return RequestOutput(
                request_id, [], finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens
            )
        # Straight into the running batch (its seat was promised at reservation): a
        # waiting request must never hold blocks, or the queue head could starve on them.
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request in any state and free its blocks. Idempotent."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.pool.free(held)
            return None
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_KV:
            del self.remote[request_id]
        elif req.status is RequestStatus.RESERVING:
            self.reserving.remove(req)
        req.hold_kv = False
        self._finish(req, FinishReason.ABORT)
        return RequestOutput(
            request_id,
            [],
            finish_reason=FinishReason.ABORT,
            num_prompt_tokens=req.num_prompt_tokens,
        )

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished ``hold_kv`` request kept. Idempotent."""
        blocks = self.held.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    # -- the step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        out = SchedulerOutput(self._step_id)
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        # Running decodes first, then the rest of running chunked prefills, so a long
        # prompt never starves the tokens of requests already generating.
        for decodes in (True, False):
            if not decodes and out.seqs and self.max_prefill_while_decoding:
                # Streams are decoding in this step: bound what prompts add to it.
                budget = min(budget, self.max_prefill_while_decoding)
            i = 0
            while i < len(self.running) and budget > 0:
                req = self.running[i]
                remaining = self._logical_len(req) - req.num_computed_tokens
                if (
                    req.request_id in scheduled
                    or remaining <= 0
                    or not req.wants_more_tokens
                    or (remaining == 1) != decodes
                ):
                    i += 1
                    continue
                num_new = min(remaining, budget)
                if not self._make_room(req, num_new, scheduled, out):
                    continue  # req itself was preempted; running[i] is the next one
                budget -= self._emit(req, num_new, out)
                scheduled.add(req.request_id)
                i = self.running.index(req) + 1
        if not out.preempted_ids:
            self._admit(budget, out)
        written = {
            b
            for seq in out.seqs
            for b in seq.block_ids[
                seq.start // self.block_size : self._blocks_for(seq.start + seq.num_new)
            ]
        }
        if written:
            self._writing[out.step_id] = frozenset(written)
        return out

    def _make_room(
        self, req: Request, num_new: int, scheduled: set[str], out: SchedulerOutput
    ) -> bool:
        """Give ``req`` the blocks for ``num_new`` more tokens, preempting the newest
        running requests not yet in this step; False if ``req`` itself had to go.

        ``req`` is one of the candidates: when it is the newest, it goes itself rather than
        take the blocks of a request that was admitted before it (vLLM's policy too).
        """
        need = self._blocks_for(req.num_computed_tokens + num_new) - len(req.block_ids)
        while need > self.pool.num_free:
            victim = next(
                (r for r in reversed(self.running) if r.request_id not in scheduled), None
            )
            if victim is None or victim is req:
                self.running.remove(req)
                self._preempt(req, out)
                return False
            self.running.remove(victim)
            self._preempt(victim, out)
        self._grow(req, need)
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        while (
            self.waiting and budget > 0 and len(self.running) + len(self.remote) < self.max_num_seqs
        ):
            req = self.waiting[0]
            hits: list[int] = []
            if req.num_computed_tokens == 0:
                hits = self._match_prefix(req)
            start = max(req.num_computed_tokens, len(hits) * self.block_size)
            num_new = min(self._logical_len(req) - start, budget)
            have = len(req.block_ids) + len(hits)
            need = self._blocks_for(start + num_new) - have
            revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)
            if need + revived > self.pool.num_free:
                break
            self.waiting.popleft()
            if hits:
                self.pool.share(hits)
                req.block_ids = hits
                req.num_registered_blocks = len(hits)
            if req.num_computed_tokens == 0:
                hit_tokens = len(hits) * self.block_size
                self.pool.record_lookup(req.num_tokens, hit_tokens)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = hit_tokens
            req.num_computed_tokens = start
            self._grow(req, need)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            budget -= self._emit(req, num_new, out)

    def update(
        self, sched: SchedulerOutput, sampled: list[SampledToken | None]
    ) -> list[RequestOutput]:
        """Apply a finished step's results; returns one output per request that moved.

        ``sampled`` is aligned with ``sched.seqs`` (None where nothing was sampled).
        Results for requests that finished or were aborted meanwhile are dropped.
        """
        self._writing.pop(sched.step_id, None)
        outputs: list[RequestOutput] = []
        for seq, tok in zip(sched.seqs, sampled, strict=True):
            req = seq.request
            if req.is_finished:
                continue
            confirmed = seq.start + seq.num_new
            if tok is None:
                if req.num_computed_tokens >= confirmed:
                    self._register_full_blocks(req, confirmed)
                continue
            req.num_pending_tokens -= 1
            req.all_token_ids.append(tok.token_id)
            self.num_generated_tokens_total += 1
            if req.num_computed_tokens >= confirmed:
                self._register_full_blocks(req, confirmed)
            reason = self._stop_reason(req, tok.token_id)
            output = RequestOutput(
                req.request_id,
                [tok.token_id],
                logprobs=[tok.logprob] if tok.logprob is not None else None,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
            if req.num_output_tokens == 1 and req.scheduled_time is not None:
                output.timings = _first_token_timings(req)
            if req.num_output_tokens == 1 and req.params.prompt_logprobs is not None:
                output.prompt_logprobs = req.prompt_logprobs[: req.num_prompt_tokens - 1]
            if reason is not None:
                if req.status is RequestStatus.RUNNING:
                    self.running.remove(req)
                elif req.status is RequestStatus.WAITING:
                    self.waiting.remove(req)
                output.finish_reason = reason
                if req.hold_kv:
                    output.held_block_ids = list(req.block_ids)
                self._finish(req, reason)
            outputs.append(output)
        return outputs

    # -- stats ------------------------------------------------------------------------

    @property
    def num_held_blocks(self) -> int:
        return sum(len(b) for b in self.held.values())

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens admitted but not yet computed (the prefill load signal)."""
        running = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)
        return running + sum(r.num_prompt_tokens - r.num_computed_tokens for r in self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- internals --------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def _logical_len(req: Request) -> int:
        return req.num_tokens + req.num_pending_tokens

    def _grow(self, req: Request, need: int) -> None:
        if need > 0:
            blocks = self.pool.allocate(need)
            assert blocks is not None
            req.block_ids = req.block_ids + blocks

    def _emit(self, req: Request, num_new: int, out: SchedulerOutput) -> int:
        start = req.num_computed_tokens
        end = start + num_new
        logical = self._logical_len(req)
        known = req.num_tokens
        ids = req.all_token_ids[start : min(end, known)]
        if end > known:
            assert end == known + 1 and req.num_pending_tokens == 1
            ids.append(PENDING_TOKEN)
        sample = end == logical
        out.seqs.append(
            ScheduledSeq(req, start, num_new, sample, ids, req.block_ids[: self._blocks_for(end)])
        )
        out.num_batched_tokens += num_new
        req.num_computed_tokens = end
        if sample:
            req.num_pending_tokens += 1
        return num_new

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        logger.info("preempting request %s (recompute)", req.request_id)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        out.preempted_ids.append(req.request_id)

    def _hashes_upto(self, req: Request, num_blocks: int) -> list[int]:
        hashes = req.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            b = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, req.all_token_ids[b * bs : (b + 1) * bs]))
        return hashes[:num_blocks]

    def _match_prefix(self, req: Request) -> list[int]:
        if not self.pool.enable_prefix_caching or req.params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position's logits: a cached block has none.
            return []
        # Leave at least one token to compute, so the step has logits to sample from.
        max_blocks = (self._logical_len(req) - 1) // self.block_size
        hashes = self._hashes_upto(req, max_blocks)
        bs = self.block_size
        keys = [tuple(req.all_token_ids[b * bs : (b + 1) * bs]) for b in range(max_blocks)]
        return self.pool.match_prefix(hashes, keys)

    def _register_full_blocks(self, req: Request, computed: int) -> None:
        if not self.pool.enable_prefix_caching:
            return
        full = min(computed, req.num_tokens) // self.block_size
        full = min(full, len(req.block_ids))
        if full <= req.num_registered_blocks:
            return
        hashes = self._hashes_upto(req, full)
        bs = self.block_size
        for b in range(req.num_registered_blocks, full):
            parent = hashes[b - 1] if b else ROOT_HASH
            parent_block = self.pool.canonical(req.block_ids[b - 1]) if b else NO_PARENT
            self.pool.cache_block(
                req.block_ids[b], parent, req.all_token_ids[b * bs : (b + 1) * bs], parent_block
            )
        req.num_registered_blocks = full

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        n_out = req.num_output_tokens
        # The sampler masks stop tokens while fewer than min_tokens were produced, so
        # one can only legitimately appear after that.
        if n_out > params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                return FinishReason.STOP
        if n_out >= params.max_tokens or req.num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        if req.hold_kv and reason is not FinishReason.ABORT:
            self.held[req.request_id] = req.block_ids
        else:
            self.pool.free(req.block_ids)
        req.block_ids = []


def _first_token_timings(req: Request) -> RequestTimings:
    """Queue and prefill time of a request that just sampled its first token here."""
    assert req.scheduled_time is not None
    return RequestTimings(
        queued_s=req.scheduled_time - req.arrival_time,
        prefill_s=time.monotonic() - req.scheduled_time,
    )
