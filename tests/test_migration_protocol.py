"""gateway.routing.migration without gRPC: which failures move a request, and what the move
sends."""

from __future__ import annotations

import pytest

from engine import errors
from engine.request import FinishReason, RequestOutput, RequestTimings
from engine.sampling_params import SamplingParams
from gateway.routing.migration import BrokenStreamError, MoveReason, StreamProgress, move_reason
from protos.baton.v1 import worker_pb2
from rpc.errors import RoleExhaustedError, WorkerDrainingError


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (errors.UnavailableError("connection reset"), MoveReason.WORKER_GONE),
        (WorkerDrainingError("draining"), MoveReason.DRAINING),
        (BrokenStreamError("no finish reason"), MoveReason.BROKEN_STREAM),
        (errors.AbortedError("KV epoch is stale"), None),
        (errors.ResourceExhaustedError("full"), None),
        (RoleExhaustedError("full", worker_pb2.WORKER_ROLE_PREFILL), None),
        (errors.DeadlineExceededError("late"), None),
        (ValueError("bad"), None),
        (errors.CancelledError("client"), None),
    ],
)
def test_only_a_worker_leaving_moves_a_request(error: Exception, reason: MoveReason | None) -> None:
    assert move_reason(error) is reason


def _out(tokens: list[int], **kw: object) -> RequestOutput:
    return RequestOutput("r", tokens, **kw)  # type: ignore[arg-type]


def test_nothing_emitted_resumes_with_the_original_request() -> None:
    params = SamplingParams(max_tokens=10, seed=7, temperature=0.8)
    progress = StreamProgress((1, 2, 3), params)
    assert progress.resume() == ([1, 2, 3], params)
    assert not progress.started


def test_a_move_sends_prompt_and_outputs_with_what_is_left_of_the_budget() -> None:
    params = SamplingParams(
        max_tokens=10, min_tokens=4, seed=7, temperature=0.8, stop_token_ids=(5,), logprobs=2
    )
    progress = StreamProgress((1, 2, 3), params)
    progress.record(_out([40, 41]))
    progress.record(_out([42]))
    prompt, moved = progress.resume()
    assert prompt == [1, 2, 3, 40, 41, 42]
    assert (moved.max_tokens, moved.min_tokens, moved.output_offset) == (7, 1, 3)
    assert (moved.seed, moved.temperature, moved.stop_token_ids, moved.logprobs) == (
        7,
        0.8,
        (5,),
        2,
    )
    # A second move counts from the original output's start, not the previous attempt's.
    progress.moves = 1
    progress.record(_out([43, 44, 45, 46]))
    prompt, moved = progress.resume()
    assert prompt == [1, 2, 3, 40, 41, 42, 43, 44, 45, 46]
    assert (moved.max_tokens, moved.min_tokens, moved.output_offset) == (3, 0, 7)
    assert progress.remaining == 3


def test_outputs_after_a_move_report_the_original_prompt_and_no_worker_phases() -> None:
    progress = StreamProgress((1, 2, 3), SamplingParams(max_tokens=5))
    first = progress.record(
        _out([9], num_prompt_tokens=3, num_cached_tokens=2, timings=RequestTimings(prefill_s=0.1))
    )
    assert (first.num_prompt_tokens, first.num_cached_tokens) == (3, 2)
    assert first.timings is not None
    progress.moves = 1
    moved = progress.record(
        _out(
            [10],
            num_prompt_tokens=4,
            num_cached_tokens=4,
            timings=RequestTimings(prefill_s=0.3),
            finish_reason=FinishReason.LENGTH,
        )
    )
    assert (moved.num_prompt_tokens, moved.num_cached_tokens, moved.timings) == (3, 0, None)
    assert progress.emitted == [9, 10]


def test_output_offset_is_validated() -> None:
    with pytest.raises(ValueError, match="output_offset"):
        SamplingParams(output_offset=-1)
