"""decode_service.timings: the first output carries the phases up to the first token, the
last one all of them (first token, decode and total measured from the call's arrival)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from decode_service.timings import with_timings
from engine.request import FinishReason, RequestOutput, RequestTimings

ENGINE = RequestTimings(queued_s=0.01, prefill_s=0.02)


async def _outputs(*outs: RequestOutput, gap_s: float = 0.02) -> AsyncIterator[RequestOutput]:
    for out in outs:
        await asyncio.sleep(gap_s)
        yield out


async def test_first_and_last_outputs_carry_the_timings() -> None:
    began = time.monotonic()
    outs = [
        o
        async for o in with_timings(
            _outputs(
                RequestOutput("r", [1], timings=ENGINE),
                RequestOutput("r", [2]),
                RequestOutput("r", [3], finish_reason=FinishReason.LENGTH),
            ),
            began,
        )
    ]
    first, middle, last = (o.timings for o in outs)
    assert first is not None and last is not None and middle is None
    assert (first.queued_s, first.prefill_s) == (0.01, 0.02)
    assert first.first_token_s is not None and first.first_token_s >= 0.02
    assert first.decode_s is None and first.total_s is None
    assert (last.queued_s, last.prefill_s, last.first_token_s) == (0.01, 0.02, first.first_token_s)
    assert last.decode_s is not None and last.decode_s >= 0.04
    assert last.total_s == pytest.approx(last.first_token_s + last.decode_s)


async def test_a_request_that_ends_without_tokens_has_only_its_total() -> None:
    (out,) = [
        o
        async for o in with_timings(
            _outputs(RequestOutput("r", [], finish_reason=FinishReason.ABORT)), time.monotonic()
        )
    ]
    assert out.timings is not None and out.timings.total_s is not None
    assert (out.timings.first_token_s, out.timings.decode_s) == (None, None)
