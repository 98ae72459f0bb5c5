"""The gateway's deltas -> OpenAI responses: whole (non-streaming) or as SSE chunks.

One :class:`ResponseBuilder` per request. ``chunks(delta)`` gives the stream's chunk
objects for one delta (a chat stream opens with a chunk carrying only the role), and
``usage_chunk`` the extra last chunk of ``stream_options.include_usage``; ``add(delta)``
accumulates for ``response()``, the non-streaming body. Log-probabilities come in the
endpoint's own shape: ``{tokens, token_logprobs, top_logprobs, text_offset}`` for
completions, ``{content: [{token, logprob, bytes, top_logprobs}]}`` for chat.

Tool calls (a request with ``tools``; gateway.tools.plan): the message carries
``tool_calls`` (content null) and the finish reason is ``tool_calls`` when the output
parses as calls (gateway.tools.calls); otherwise the text is the content, as without
tools. Streaming a named function's call sends the arguments as they are generated
(``tool_calls[0].function.arguments`` deltas after one delta with its id and name); with
``auto`` or ``required`` the reply is read as it streams (gateway.tools.call_stream):
content as content, each call opened once its name is complete, its arguments as they
are generated. With ``n > 1`` each choice is shaped on its own.

baton's one extension: ``baton_timings``, the request's per-phase timings in seconds
(``queued_s``, ``reserved_s``, ``prefill_s``, ``transfer_s``, ``first_token_s``,
``decode_s``, ``total_s``; a phase that did not happen is left out), on the
non-streaming response and on the last chunk of a stream (the usage chunk when
``stream_options.include_usage`` asks for one, else the chunk with the finish reason).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import AbortedError
from engine.request import FinishReason, RequestTimings, TokenLogprob
from gateway.http.request import Endpoint, OpenAIRequest
from gateway.text.output_processor import GenerateDelta, Usage
from gateway.tools.call_stream import ToolCallStream, stream_delta
from gateway.tools.calls import new_call_id, parse_tool_calls
from gateway.tools.plan import ToolChoice

SSE_DONE = b"data: [DONE]\n\n"
TIMINGS_KEY = "baton_timings"  # baton's extension field (see the module doc)
# JSON has no infinities; a token the filters ruled out is reported at this floor (as vLLM).
MIN_LOGPROB = -9999.0


def sse_event(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage_dict(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.migrations:  # baton's own key, only on a request that moved between workers
        out["baton_migrations"] = usage.migrations
    return out


def finish_reason_of(delta: GenerateDelta) -> str | None:
    """OpenAI's finish reason for a delta; a request the worker aborted is a failure."""
    if delta.stop_string is not None:
        return "stop"
    if delta.finish_reason is None:
        return None
    if delta.finish_reason is FinishReason.ABORT:
        raise AbortedError("the request was aborted by the decode worker")
    return delta.finish_reason.value  # "stop" or "length", as OpenAI spells them


@dataclass(slots=True)
class _Choice:
    """What a response has of one of its choices."""

    text: list[str] = field(default_factory=list)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    text_offset: int = 0  # characters of completion text before the next token
    finish_reason: str | None = None
    sent_role: bool = False
    echo_pending: bool = False
    named_call_id: str | None = None  # a streamed named tool call, once it opened
    calls: ToolCallStream | None = None  # auto/required: the reply read as it streams
    held_logprobs: dict[str, list[Any]] = field(default_factory=dict)  # not yet sent


class ResponseBuilder:
    """Shapes one request's deltas. ``token_text`` renders one token id (for logprobs).

    With ``n > 1`` each delta belongs to the choice its ``index`` names; a stream's
    chunks carry that index, a whole response lists the choices in order.

    With ``echo`` (completions), ``prompt_text`` leads each choice's text, and with
    logprobs the prompt's tokens lead them (the first with ``null``, as OpenAI and vLLM
    return it); both come with a choice's first delta (streamed: in its first chunk).
    The prompt's logprobs arrive once, with choice 0's first delta, which precedes every
    other choice's (the decode worker starts them after it).
    """

    def __init__(
        self,
        req: OpenAIRequest,
        request_id: str,
        created: int,
        token_text: Callable[[int], str],
        *,
        prompt_text: str = "",
    ) -> None:
        self._req = req
        self._chat = req.endpoint is Endpoint.CHAT
        self.id = ("chatcmpl-" if self._chat else "cmpl-") + request_id
        self._created = created
        self._token_text = token_text
        n = req.input.params.n
        self._choices = [_Choice(echo_pending=req.echo) for _ in range(n)]
        self._usage: Usage | None = None
        self._timings: RequestTimings | None = None
        self._prompt_text = prompt_text
        self._prompt_ids: list[int] = []
        self._prompt_logprobs: list[TokenLogprob] = []
        self._plan = req.tools if self._chat else None

    # -- streaming ----------------------------------------------------------------------

    def chunks(self, delta: GenerateDelta) -> list[dict[str, Any]]:
        """The chunks for one delta (a choice's finished one carries its finish reason)."""
        finish = finish_reason_of(delta)
        choice = self._choices[delta.index]
        out = []
        if self._chat and not choice.sent_role:
            choice.sent_role = True
            out.append(self._chunk(delta.index, {"role": "assistant", "content": ""}, None, None))
        text, logprobs = self._parts(choice, delta)
        if self._plan is not None:
            out += self._tool_chunks(delta.index, choice, text, logprobs, finish)
        else:
            content: Any = text
            if self._chat:
                content = {"content": text} if text else {}
            out.append(self._chunk(delta.index, content, logprobs, finish))
        if delta.last:
            self._timings = delta.timings
            if not self._req.include_usage:
                self._add_timings(out[-1])
        return out

    def _tool_chunks(
        self,
        index: int,
        c: _Choice,
        text: str,
        logprobs: dict[str, list[Any]] | None,
        finish: str | None,
    ) -> list[dict[str, Any]]:
        """A stream's chunks of one choice of a request that may call tools (see the
        module doc)."""
        assert self._plan is not None
        out = []
        if self._plan.choice is ToolChoice.NAMED:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if c.named_call_id is None:
                c.named_call_id = new_call_id()
                call |= {"id": c.named_call_id, "type": "function"}
                call["function"] = {"name": self._plan.named, "arguments": text}
            if text or "id" in call:
                out.append(self._chunk(index, {"tool_calls": [call]}, logprobs, None))
            if finish is not None:
                reason = "tool_calls" if finish == "stop" else finish
                out.append(self._chunk(index, {}, None, reason))
            return out
        for key, values in (logprobs or {}).items():
            c.held_logprobs.setdefault(key, []).extend(values)
        if c.calls is None:
            c.calls = ToolCallStream(self._plan)
        events = c.calls.feed(text)
        if finish is not None:
            events += c.calls.finish()
        for event in events:
            held = (c.held_logprobs or None) if self._req.logprobs else None
            c.held_logprobs = {}
            out.append(self._chunk(index, stream_delta(event), held, None))
        if finish is not None:
            held = (c.held_logprobs or None) if self._req.logprobs else None
            out.append(self._chunk(index, {}, held, "tool_calls" if c.calls.called else finish))
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage (it carries the timings)."""
        return self._add_timings(self._envelope(self._object("chunk"), [], usage=usage_dict(usage)))

    def _add_timings(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self._timings is not None:
            obj[TIMINGS_KEY] = self._timings.as_dict()
        return obj

    def _chunk(self, index: int, content: Any, logprobs: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        choice["delta" if self._chat else "text"] = content
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        extra = {"usage": None} if self._req.include_usage else {}
        return self._envelope(self._object("chunk"), [choice], **extra)

    # -- whole --------------------------------------------------------------------------

    def add(self, delta: GenerateDelta) -> None:
        finish = finish_reason_of(delta)
        choice = self._choices[delta.index]
        text, logprobs = self._parts(choice, delta)
        choice.text.append(text)
        for key, values in (logprobs or {}).items():
            choice.logprobs.setdefault(key, []).extend(values)
        if finish is not None:
            choice.finish_reason = finish
        if delta.last:
            self._usage, self._timings = delta.usage, delta.timings

    def response(self) -> dict[str, Any]:
        assert self._usage is not None, "response() comes after the last delta"
        choices = [self._whole_choice(i, c) for i, c in enumerate(self._choices)]
        whole = self._envelope(self._object("whole"), choices, usage=usage_dict(self._usage))
        return self._add_timings(whole)

    def _whole_choice(self, index: int, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        logprobs: dict[str, Any] | None = None
        if self._req.logprobs:
            empty = {"content": []} if self._chat else self._format_logprobs(_Choice(), [])
            whole: dict[str, Any] = {**empty, **c.logprobs}
            if self._chat:
                whole["refusal"] = None
            logprobs = whole
        choice: dict[str, Any] = {"index": index}
        finish_reason = c.finish_reason
        if self._chat:
            choice["message"] = {"role": "assistant", "content": text}
            calls = parse_tool_calls(text, self._plan) if self._plan is not None else None
            if calls is not None:
                choice["message"] = {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [call.as_dict() for call in calls],
                }
                finish_reason = "tool_calls"
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return choice

    # -- shared -------------------------------------------------------------------------

    def _object(self, kind: str) -> str:
        if self._chat:
            return "chat.completion.chunk" if kind == "chunk" else "chat.completion"
        return "text_completion"

    def _envelope(self, obj: str, choices: list[Any], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self._created,
            "model": self._req.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }

    def _parts(self, c: _Choice, delta: GenerateDelta) -> tuple[str, dict[str, list[Any]] | None]:
        """A delta's text and logprobs, led by the prompt's on its choice's first delta
        when the request echoes."""
        if delta.prompt_logprobs is not None:
            self._prompt_ids = list(delta.prompt_token_ids or [])
            self._prompt_logprobs = delta.prompt_logprobs
        echo, c.echo_pending = c.echo_pending, False
        text = self._prompt_text + delta.text if echo else delta.text
        if not self._req.logprobs:
            return text, None
        if not echo:
            return text, self._format_logprobs(c, delta.logprobs)
        ids, lps = self._prompt_ids, self._prompt_logprobs
        assert len(lps) == len(ids) - 1, "the prompt's logprobs come with choice 0's first token"
        prompt = self._format_logprobs(c, [TokenLogprob(ids[0], 0.0, 0, []), *lps])
        prompt["token_logprobs"][0] = prompt["top_logprobs"][0] = None  # position 0 has none
        out = self._format_logprobs(c, delta.logprobs)
        return text, {key: prompt[key] + out[key] for key in out}

    def _format_logprobs(self, c: _Choice, lps: list[TokenLogprob]) -> dict[str, list[Any]]:
        if self._chat:
            return {"content": [self._chat_logprob(lp) for lp in lps]}
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for lp in lps:
            token = self._token_text(lp.token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(_finite(lp.logprob))
            out["top_logprobs"].append({self._token_text(t): _finite(v) for t, v in lp.top})
            out["text_offset"].append(c.text_offset)
            c.text_offset += len(token)
        return out

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        entry = self._chat_token(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._chat_token(t, v) for t, v in lp.top]
        return entry

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token_text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB
