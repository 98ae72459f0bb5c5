"""The client's typed records and their one mapping to and from ``baton.v1`` messages.

Users build a :class:`SamplingParams` and get :class:`Chunk` (one streamed delta),
:class:`Completion` (a whole answer), :class:`Usage` and :class:`ModelInfo` back; the wire
messages stay inside the client. Values are not checked here: the gateway validates every
request once and answers INVALID_ARGUMENT naming the field
(:class:`~protos.client.errors.InvalidRequestError`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from protos.baton.v1 import common_pb2, generate_pb2
from protos.client.tools import Tool, ToolCall, ToolChoiceSpec, add_tools, add_turn

#: One chat turn: ``("user", "Hi!")`` or ``{"role": "user", "content": "Hi!"}``; a mapping
#: may carry an assistant turn's ``tool_calls`` and a tool turn's ``tool_call_id``.
ChatTurn = tuple[str, str] | Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``None`` (every default) leaves a field to the
    server's default; see ``protos/baton/v1/common.proto`` for each default and range."""

    max_tokens: int | None = None
    temperature: float | None = None  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    logprobs: int | None = None  # how many alternatives per token; None: no logprobs
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # token id -> bias added to its logit, in [-100, 100]; at most 300 entries.
    logit_bias: Mapping[int, float] | None = None
    # Alternatives per prompt token; None: no prompt logprobs (Chunk.prompt_logprobs).
    prompt_logprobs: int | None = None
    n: int | None = None  # choices from the one prompt; chunks carry their ``index``

    def to_proto(self) -> common_pb2.SamplingParameters:
        msg = common_pb2.SamplingParameters(
            stop_token_ids=self.stop_token_ids, logit_bias=dict(self.logit_bias or {})
        )
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name not in ("stop_token_ids", "logit_bias") and value is not None:
                setattr(msg, field.name, value)
        return msg


class FinishReason(enum.StrEnum):
    """Why a completion ended."""

    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the model's length limit
    STOP_STRING = "stop_string"  # one of the request's stop strings matched
    ABORT = "abort"  # cancelled or aborted before it finished
    TOOL_CALLS = "tool_calls"  # the reply parsed as calls of the request's tools


_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_STOP_STRING: FinishReason.STOP_STRING,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    common_pb2.FINISH_REASON_TOOL_CALLS: FinishReason.TOOL_CALLS,
}


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    # Times the request moved to another decode worker mid-stream (its worker died or
    # drained); the stream went on without a gap.
    migrations: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one generated token and of its best alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed delta: what was generated since the previous chunk.

    ``text`` may be empty while a multi-byte character or a possible stop string is
    incomplete. ``finish_reason``, ``usage`` and ``timings`` are set on the last chunk
    only; ``timings`` maps each phase the server knows (``queued_s``, ``reserved_s``,
    ``prefill_s``, ``transfer_s``, ``first_token_s``, ``decode_s``, ``total_s``) to its
    seconds.

    With ``n`` > 1, ``index`` names the choice; each choice's last chunk has its
    ``finish_reason``, and ``usage`` and ``timings`` come on the stream's last chunk.
    ``prompt_logprobs`` (asked for with ``SamplingParams.prompt_logprobs``) come on the
    first chunk: one per prompt token after the first.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: dict[str, float] | None = None
    index: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # With tools: on a choice's last chunk, the calls its reply made (finish_reason
    # TOOL_CALLS); the text and token ids stream as without tools.
    tool_calls: tuple[ToolCall, ...] = ()

    @classmethod
    def from_proto(cls, msg: generate_pb2.GenerateResponse) -> Chunk:
        return cls(
            tool_calls=tuple(ToolCall.from_proto(c) for c in msg.tool_calls),
            request_id=msg.request_id,
            text=msg.text,
            token_ids=tuple(msg.token_ids),
            logprobs=tuple(_logprob(lp) for lp in msg.logprobs),
            index=msg.index,
            prompt_logprobs=tuple(_logprob(lp) for lp in msg.prompt_logprobs),
            finish_reason=_FINISH_REASONS.get(msg.finish_reason),
            usage=(
                Usage(
                    prompt_tokens=msg.usage.prompt_tokens,
                    completion_tokens=msg.usage.completion_tokens,
                    cached_tokens=msg.usage.cached_tokens,
                    migrations=msg.usage.migrations,
                )
                if msg.HasField("usage")
                else None
            ),
            timings=(
                {f.name: value for f, value in msg.timings.ListFields()}
                if msg.HasField("timings")
                else None
            ),
        )


def _logprob(lp: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=tuple((t.token_id, t.logprob) for t in lp.top),
    )


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole answer: the chunks of one stream joined."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason
    usage: Usage
    timings: dict[str, float] | None = None  # as on the last chunk
    tool_calls: tuple[ToolCall, ...] = ()  # as on the last chunk

    @classmethod
    def from_chunks(cls, chunks: Iterable[Chunk]) -> Completion:
        """Join a finished stream's chunks; the last one must carry finish reason and usage."""
        chunks = list(chunks)
        if not chunks or chunks[-1].finish_reason is None or chunks[-1].usage is None:
            raise ValueError("the stream ended without a finish reason and usage")
        if any(c.index for c in chunks):
            raise ValueError("a stream of n > 1 choices: read its chunks by their index")
        return cls(
            request_id=chunks[-1].request_id,
            text="".join(c.text for c in chunks),
            token_ids=tuple(t for c in chunks for t in c.token_ids),
            logprobs=tuple(lp for c in chunks for lp in c.logprobs),
            finish_reason=chunks[-1].finish_reason,
            usage=chunks[-1].usage,
            timings=chunks[-1].timings,
            tool_calls=chunks[-1].tool_calls,
        )


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the gateway serves."""

    model_id: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    max_logprobs: int

    @classmethod
    def from_proto(cls, msg: generate_pb2.ModelInfoResponse) -> ModelInfo:
        return cls(
            model_id=msg.model_id,
            vocab_size=msg.vocab_size,
            max_model_len=msg.max_model_len,
            eos_token_ids=tuple(msg.eos_token_ids),
            has_chat_template=msg.has_chat_template,
            max_logprobs=msg.max_logprobs,
        )


def generate_request(
    *,
    text: str | None = None,
    chat: Sequence[ChatTurn] | None = None,
    token_ids: Sequence[int] | None = None,
    sampling: SamplingParams | None = None,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool | None = None,
    skip_special_tokens: bool | None = None,
    request_id: str | None = None,
    tools: Sequence[Tool] | None = None,
    tool_choice: ToolChoiceSpec | None = None,
) -> generate_pb2.GenerateRequest:
    """The wire request. Exactly one of ``text``, ``chat`` or ``token_ids`` must be given
    (TypeError otherwise: it is a mistake in the calling code, not in the data)."""
    given = [
        name
        for name, v in (("text", text), ("chat", chat), ("token_ids", token_ids))
        if v is not None
    ]
    if len(given) != 1:
        raise TypeError(f"give exactly one of text, chat or token_ids; got {given or 'none'}")
    if isinstance(stop, str):
        raise TypeError("stop must be a sequence of strings, not one string")
    msg = generate_pb2.GenerateRequest(stop=stop)
    if sampling is not None:
        msg.sampling_params.CopyFrom(sampling.to_proto())
    if text is not None:
        msg.text = text
    elif chat is not None:
        msg.chat.SetInParent()  # an empty conversation is still a chat prompt
        for turn in chat:
            if isinstance(turn, Mapping):
                add_turn(msg.chat, turn)
            else:
                msg.chat.messages.add(role=turn[0], content=turn[1])
    elif token_ids is not None:
        msg.token_ids.SetInParent()
        msg.token_ids.ids.extend(token_ids)
    if request_id is not None:
        msg.request_id = request_id
    if include_stop_str_in_output is not None:
        msg.include_stop_str_in_output = include_stop_str_in_output
    if skip_special_tokens is not None:
        msg.skip_special_tokens = skip_special_tokens
    add_tools(msg, tools, tool_choice)
    return msg
