"""A request's per-phase timings as a decode worker reports them.

The hand-off (``decode_service.handoff``) or, single-process, the engine's scheduler puts
the phases up to the first token on the request's first output (reserved, queued,
prefill, transfer); :func:`with_timings` adds what only the end of the stream knows:
``first_token_s`` (from the ``Decode`` call's arrival), ``decode_s`` (first token to
last) and ``total_s``. The first output carries what is known then, the last all of it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from engine.request import RequestOutput, RequestTimings


async def with_timings(
    outputs: AsyncIterator[RequestOutput], began: float
) -> AsyncIterator[RequestOutput]:
    """``outputs`` with their timings filled in; ``began``: the request's arrival, as
    ``time.monotonic()``."""
    known = RequestTimings()
    first_at: float | None = None
    async for out in outputs:
        now = time.monotonic()
        if first_at is None and out.new_token_ids:
            first_at = now
            known = known.merged(out.timings).merged(RequestTimings(first_token_s=now - began))
            out.timings = known
        if out.finished:
            decode_s = None if first_at is None else now - first_at
            out.timings = known.merged(out.timings).merged(
                RequestTimings(decode_s=decode_s, total_s=now - began)
            )
        yield out
