"""Moving a request to another decode worker mid-stream: when, and what the move sends.

A decode worker that is killed, evicted or scaled down ends the streams it holds. Once
tokens of a request have reached its client, the gateway does not retry it from the
start (the client already has them); it *moves* it: a new ``Decode`` on another decode
worker whose prompt is the original prompt followed by every token already streamed,
with what is left of the budget (``max_tokens``, ``min_tokens``) and
``SamplingParams.output_offset`` saying how many of the prompt's tokens are earlier
outputs. Seeded draws are a function of (seed, output position) and the output-only
penalties count from the original output's start, so the moved request continues as it
would have where it was: in fp32, greedy and seeded text equal an undisturbed run. In
bf16 the re-prefilled KV is computed in another batch shape than the KV it replaces,
so a near-tie between two tokens can resolve the other way after a move (the same bound
as any bf16 batch-shape difference, ``tests/test_bf16_logits.py``).

Which failures move a request (:func:`move_reason`):

- UNAVAILABLE: the worker is gone (killed, connection lost) or stopping;
- ABORTED carrying the drain marker (:class:`rpc.errors.WorkerDrainingError`): a draining
  decode worker handing off the streams that outlasted its finish bound;
- a stream that broke its protocol (:class:`BrokenStreamError`): it ended without a
  finish reason, or sent a malformed message.

Anything else (INVALID_ARGUMENT, DEADLINE_EXCEEDED, a plain ABORTED, ...) ends the
request with its own status. Stop strings are matched in the gateway on the whole
output, so they need nothing here. This module is pure: the dispatcher runs it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.errors import AbortedError, UnavailableError
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from rpc.errors import WorkerDrainingError


class MoveReason(enum.Enum):
    """Why a request moved: the ``reason`` label of ``baton_request_migrations_total``."""

    WORKER_GONE = "worker_gone"
    DRAINING = "draining"
    BROKEN_STREAM = "broken_stream"


class BrokenStreamError(AbortedError):
    """A ``Decode`` stream that broke its protocol: it ended without a finish reason, or
    sent a message that does not parse."""


def move_reason(exc: BaseException) -> MoveReason | None:
    """The reason a failure after the first token moves the request, or None when it
    ends the request."""
    if isinstance(exc, WorkerDrainingError):
        return MoveReason.DRAINING
    if isinstance(exc, BrokenStreamError):
        return MoveReason.BROKEN_STREAM
    if isinstance(exc, UnavailableError):
        return MoveReason.WORKER_GONE
    return None


@dataclass(frozen=True, slots=True)
class Move:
    """One move of a request, as the gateway reports it (metric, span event, log)."""

    reason: MoveReason
    source: str  # the decode worker the stream failed on
    number: int  # 1 for the request's first move
    emitted: int  # tokens the client had when the stream failed
    error: str  # the failure, as the worker or the channel described it


@dataclass(slots=True)
class StreamProgress:
    """What of a request has reached the gateway's caller, and the request that resumes it.

    ``record`` every output yielded onward; ``resume`` gives the prompt and parameters of
    the next attempt (the original ones while nothing was emitted).
    """

    prompt_token_ids: Sequence[int]
    params: SamplingParams
    emitted: list[int] = field(default_factory=list)
    moves: int = 0

    @property
    def started(self) -> bool:
        return bool(self.emitted)

    @property
    def remaining(self) -> int:
        """Tokens the request may still produce."""
        return self.params.max_tokens - len(self.emitted)

    def record(self, out: RequestOutput) -> RequestOutput:
        """Note ``out``'s tokens; returns it as the caller must see it. After a move the
        worker counts the earlier outputs as prompt: the caller gets the original prompt
        length, and no cached-token count (the prompt's was reported by the first
        attempt) nor worker phases (those of the first attempt stand)."""
        self.emitted.extend(out.new_token_ids)
        if self.moves:
            out.num_prompt_tokens = len(self.prompt_token_ids)
            out.num_cached_tokens = 0
            out.timings = None
        return out

    def resume(self) -> tuple[list[int], SamplingParams]:
        """The next attempt's prompt and parameters."""
        done = len(self.emitted)
        if not done:
            return list(self.prompt_token_ids), self.params
        # record() saw no finished output, and a worker finishes a request with its
        # max_tokens-th token: at least one token is left.
        assert done < self.params.max_tokens, (done, self.params.max_tokens)
        params = dataclasses.replace(
            self.params,
            max_tokens=self.params.max_tokens - done,
            min_tokens=max(0, self.params.min_tokens - done),
            output_offset=self.params.output_offset + done,
            # The caller has them (they came with the first token); not computed again.
            prompt_logprobs=None,
        )
        return [*self.prompt_token_ids, *self.emitted], params
