"""A request as the engine tracks it, and what the engine emits for it each step.

Torch-free. Progress is ``num_computed_tokens`` against ``num_tokens``: a prompt chunk, a
prefix-cache hit and KV that arrived from a prefill worker all just advance it.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no blocks
    RESERVING = "reserving"  # in the reservation FIFO: waits for blocks its KV will land in
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved, KV arrives from a prefill worker
    RUNNING = "running"  # has blocks, scheduled every step
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of the chosen token and of the ``top`` most likely ones."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where one request's time went, phase by phase, in seconds (``RequestTimings`` in
    common.proto says what each phase spans). None: the phase did not happen for this
    request, or the reporting side does not know it."""

    queued_s: float | None = None
    reserved_s: float | None = None
    prefill_s: float | None = None
    transfer_s: float | None = None
    first_token_s: float | None = None
    decode_s: float | None = None
    total_s: float | None = None

    def merged(self, newer: RequestTimings | None) -> RequestTimings:
        """These timings with every phase ``newer`` knows taken from it."""
        if newer is None:
            return self
        return dataclasses.replace(self, **newer.as_dict())

    def as_dict(self) -> dict[str, float]:
        """The known phases, by field name (what the HTTP API's ``baton_timings`` holds)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta, never the whole history)."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Set when the request finished with ``hold_kv``: its blocks stay allocated until
    # ``release_held`` is called, so a transfer can read them.
    held_block_ids: list[int] | None = None
    # The request's phases known when this output was made: the engine sets queued_s and
    # prefill_s on a request's first token; the services add theirs.
    timings: RequestTimings | None = None
    # On a request's first token when it asked for ``prompt_logprobs``: one entry per
    # prompt token after the first (prompt position 0 has no logprob).
    prompt_logprobs: list[TokenLogprob] | None = None
    # Which of a request's ``n`` choices this output belongs to; the engine runs one
    # sequence per request (always 0), the decode worker's fan-out numbers them.
    index: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # Prefill role: on finish, keep the blocks for a transfer instead of freeing them.
    hold_kv: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    # When the scheduler first gave the request a step (``time.monotonic()``); None
    # before that, and for a request whose KV came from a prefill worker.
    scheduled_time: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens scheduled but whose sampled id is not yet known (overlapped scheduling).
    num_pending_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the prompt's/output's full blocks, extended lazily.
    block_hashes: list[int] = field(default_factory=list)
    # How many leading blocks are registered in the prefix cache.
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # Decode role: leading prompt blocks this engine's prefix cache already held when the
    # request's blocks were reserved for a prefill worker; that worker writes the rest.
    num_reused_blocks: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Filled by the runner chunk by chunk when ``params.prompt_logprobs`` is set: entry j
    # is prompt token j + 1's (see RequestOutput.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_more_tokens(self) -> bool:
        """True while a further token may still be produced (pending ones included)."""
        return self.num_output_tokens + self.num_pending_tokens < self.params.max_tokens
