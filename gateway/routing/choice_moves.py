"""Moving a request with ``n`` > 1 choices (``SamplingParams.n``) whose decode worker died
or drained mid-stream (``gateway.routing.migration`` moves a single sequence).

The n choices ran on one decode worker, fanned out from one prefill; after the failure
each has its own past: tokens the caller has, finished or not. A finished choice stays
finished. Every unfinished one continues alone, as a single-sequence request: its own
prompt (the original prompt and its tokens so far), its own parameters (choice i's:
seeded ``seed + i``, ``SamplingParams.choice``), its own ``output_offset`` and budget
(``StreamProgress.resume``), so a seeded choice continues as its undisturbed run would.
The continuations run concurrently, each free to go to any decode worker the router
picks and to move again within the request's bound, and their outputs are merged into
the request's one stream, each tagged with its choice's ``index``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field

from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stream_merge import StreamMerge
from gateway.routing.migration import StreamProgress


@dataclass(slots=True)
class ChoicesProgress:
    """Per choice of an n > 1 stream: the tokens the caller has and whether it ended."""

    n: int
    emitted: list[list[int]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.emitted = [[] for _ in range(self.n)]
        self.finished = [False] * self.n

    def record(self, out: RequestOutput) -> None:
        self.emitted[out.index].extend(out.new_token_ids)
        if out.finished:
            self.finished[out.index] = True

    def resumes(
        self, prompt: list[int], params: SamplingParams, moves: int
    ) -> dict[int, StreamProgress]:
        """The progress each unfinished choice continues from, by choice index."""
        return {
            i: StreamProgress(prompt, params.choice(i), emitted=list(done), moves=moves)
            for i, done in enumerate(self.emitted)
            if not self.finished[i]
        }


def choice_request_id(request_id: str, index: int) -> str:
    """A continued choice's request id on the workers (the decode worker names its
    fanned-out choices so too)."""
    return f"{request_id}/{index}"


async def merge_choices(
    streams: Mapping[int, AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of every choice's stream as they come, each tagged with its choice;
    an error in one ends the whole with it, and closing it closes every stream."""
    merge: StreamMerge[RequestOutput] = StreamMerge()
    for index, stream in streams.items():
        merge.add(index, stream)
    async with contextlib.aclosing(merge.items()) as items:
        async for index, out in items:
            out.index = index
            yield out
