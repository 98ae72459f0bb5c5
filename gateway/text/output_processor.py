"""Decode's token deltas -> the client's deltas: text, stop strings, finish and usage.

Tokens are taken one at a time, so when a stop string completes in the middle of a delta
the response ends with exactly the token that completed it, and later tokens (already
generated, never shown) are dropped. Stop strings are looked for only once ``min_tokens``
tokens have been generated, as EOS and stop token ids are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request import FinishReason, RequestOutput, RequestTimings, TokenLogprob
from engine.sampling_params import SamplingParams
from gateway.text.detokenizer import Decoder, IncrementalDetokenizer
from gateway.text.stop_strings import StopStringMatcher


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting for one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Times the request moved to another decode worker mid-stream (gateway.routing.migration).
    migrations: int = 0


@dataclass(slots=True)
class GenerateDelta:
    """What the client gets for one decode delta (a delta itself, never the history)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_string: str | None = None  # set when a stop string ended the request
    usage: Usage | None = None  # set on the last delta only
    timings: RequestTimings | None = None  # set on the last delta only (gateway.generation)
    # On the first delta of a request that asked for prompt logprobs: the prompt's ids
    # and one logprob per prompt token after the first.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    index: int = 0  # the choice (SamplingParams.n > 1)
    # The request's last delta (gateway.generation sets it): with n > 1, each choice's
    # last delta is finished, and only the request's last one is ``last``.
    last: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.stop_string is not None

    @property
    def has_content(self) -> bool:
        return bool(self.token_ids or self.text)


class OutputProcessor:
    """Turns one request's decode outputs into client deltas. One per request.

    ``process`` may not be called after it returned a finished delta.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        decoder: Decoder,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.request_id = request_id
        self._prompt_token_ids = prompt_token_ids
        self._num_prompt_tokens = len(prompt_token_ids)
        self._min_tokens = params.min_tokens
        self._detokenizer = IncrementalDetokenizer(
            decoder, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._stops = StopStringMatcher(stop, include_in_output=include_stop_str_in_output)
        self._num_cached_tokens = 0
        self.num_completion_tokens = 0
        self._finished = False

    def process(self, out: RequestOutput) -> GenerateDelta:
        if self._finished:
            raise RuntimeError(f"request {self.request_id}: output after the request finished")
        delta = GenerateDelta()
        pieces: list[str] = []
        self._num_cached_tokens = max(self._num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            delta.prompt_token_ids = list(self._prompt_token_ids)
            delta.prompt_logprobs = out.prompt_logprobs
        for i, token_id in enumerate(out.new_token_ids):
            self.num_completion_tokens += 1
            delta.token_ids.append(token_id)
            if out.logprobs is not None and i < len(out.logprobs):
                delta.logprobs.append(out.logprobs[i])
            check = self.num_completion_tokens >= self._min_tokens
            result = self._stops.feed(self._detokenizer.add(token_id), check=check)
            pieces.append(result.text)
            if result.hit:
                delta.stop_string = result.stop
                break
        if delta.stop_string is None and out.finished:
            # The stream is over: release an incomplete character, then the held-back tail.
            result = self._stops.feed(self._detokenizer.flush())
            pieces.append(result.text)
            if result.hit:
                delta.stop_string = result.stop
            else:
                pieces.append(self._stops.flush())
                delta.finish_reason = out.finish_reason
        delta.text = "".join(pieces)
        if delta.finished:
            self._finished = True
            delta.usage = Usage(
                prompt_tokens=self._num_prompt_tokens,
                completion_tokens=self.num_completion_tokens,
                cached_tokens=self._num_cached_tokens,
            )
        return delta
