"""A request's ``n`` choices on one decode worker: one prompt, one hand-off, n sequences.

Choice 0 is the request as it would run alone (its prompt prefilled here or handed off by
a prefill worker). Once its first output arrives, its prompt's full KV blocks are in this
engine's prefix cache (``Scheduler.remote_kv_ready`` and every computed step register
them), so choices 1..n-1, started then, share those blocks (reference-counted, never
written again: copy-on-write by construction) and compute only the prompt's last partial
block before sampling their own first token. Each choice is seeded ``seed + i``
(``SamplingParams.choice``). The choices' outputs are merged into one stream, each
tagged with its ``index``; closing the stream aborts every choice still running.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from engine.request import RequestOutput
from engine.stream_merge import StreamMerge


async def fan_out(
    first: AsyncIterator[RequestOutput],
    start: Callable[[int], AsyncIterator[RequestOutput]],
    n: int,
) -> AsyncIterator[RequestOutput]:
    """``first``'s outputs (choice 0) and those of ``start(i)`` for i in 1..n-1, begun once
    choice 0 produced its first output, merged as they come; each output's ``index`` is
    its choice. An error in any choice ends the stream with it."""
    if n == 1:
        # Closed explicitly, so leaving early frees the request now, not at GC.
        async with contextlib.aclosing(first):  # type: ignore[type-var]
            async for out in first:
                yield out
        return
    merge: StreamMerge[RequestOutput] = StreamMerge()
    merge.add(0, first)
    started = False
    async with contextlib.aclosing(merge.items()) as items:
        async for index, out in items:
            out.index = index
            if index:  # the prompt's phases are choice 0's; a choice's own tail is not
                out.timings = None
            elif not started:
                started = True
                for i in range(1, n):
                    merge.add(i, start(i))
            yield out
