"""The gateway's deltas -> OpenAI responses: whole (non-streaming) or as SSE chunks.

One :class:`ResponseBuilder` per request. ``chunks(delta)`` gives the stream's chunk
objects for one delta (a chat stream opens with a chunk carrying only the role), and
``usage_chunk`` the extra last chunk of ``stream_options.include_usage``; ``add(delta)``
accumulates for ``response()``, the non-streaming body. Log-probabilities come in the
endpoint's own shape: ``{tokens, token_logprobs, top_logprobs, text_offset}`` for
completions, ``{content: [{token, logprob, bytes, top_logprobs}]}`` for chat.

baton's one extension: ``baton_timings``, the request's per-phase timings in seconds
(``queued_s``, ``reserved_s``, ``prefill_s``, ``transfer_s``, ``first_token_s``,
``decode_s``, ``total_s``; a phase that did not happen is left out), on the
non-streaming response and on the last chunk of a stream (the usage chunk when
``stream_options.include_usage`` asks for one, else the chunk with the finish reason).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from engine.errors import AbortedError
from engine.request import FinishReason, RequestTimings, TokenLogprob
from gateway.openai_request import Endpoint, OpenAIRequest
from gateway.output_processor import GenerateDelta, Usage

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


class ResponseBuilder:
    """Shapes one request's deltas. ``token_text`` renders one token id (for logprobs).

    With ``echo`` (completions), ``prompt_text`` leads the text, and with logprobs the
    prompt's tokens lead them (the first with ``null``, as OpenAI and vLLM return it);
    both come with the first delta (streamed: in its chunk).
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
        self._sent_role = False
        self._text: list[str] = []
        self._logprobs: dict[str, list[Any]] = {}
        self._text_offset = 0  # characters of completion text before the next token
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self._timings: RequestTimings | None = None
        self._echo_pending = req.echo
        self._prompt_text = prompt_text

    # -- streaming ----------------------------------------------------------------------

    def chunks(self, delta: GenerateDelta) -> list[dict[str, Any]]:
        """The chunks for one delta (the finished one carries the finish reason)."""
        finish = finish_reason_of(delta)
        out = []
        if self._chat and not self._sent_role:
            self._sent_role = True
            out.append(self._chunk({"role": "assistant", "content": ""}, None, None))
        if self._chat:
            logprobs = self._format_logprobs(delta.logprobs) if self._req.logprobs else None
            out.append(self._chunk({"content": delta.text} if delta.text else {}, logprobs, finish))
        else:
            text, logprobs = self._completion_parts(delta)
            out.append(self._chunk(text, logprobs, finish))
        if finish is not None:
            self._timings = delta.timings
            if not self._req.include_usage:
                self._add_timings(out[-1])
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage (it carries the timings)."""
        return self._add_timings(self._envelope(self._object("chunk"), [], usage=usage_dict(usage)))

    def _add_timings(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self._timings is not None:
            obj[TIMINGS_KEY] = self._timings.as_dict()
        return obj

    def _chunk(self, content: Any, logprobs: Any, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        choice["delta" if self._chat else "text"] = content
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        extra = {"usage": None} if self._req.include_usage else {}
        return self._envelope(self._object("chunk"), [choice], **extra)

    # -- whole --------------------------------------------------------------------------

    def add(self, delta: GenerateDelta) -> None:
        finish = finish_reason_of(delta)
        if self._chat:
            text = delta.text
            logprobs = self._format_logprobs(delta.logprobs) if self._req.logprobs else None
        else:
            text, logprobs = self._completion_parts(delta)
        self._text.append(text)
        for key, values in (logprobs or {}).items():
            self._logprobs.setdefault(key, []).extend(values)
        if finish is not None:
            self._finish_reason, self._usage = finish, delta.usage
            self._timings = delta.timings

    def response(self) -> dict[str, Any]:
        assert self._usage is not None, "response() comes after the finished delta"
        text = "".join(self._text)
        logprobs: dict[str, Any] | None = None
        if self._req.logprobs:
            empty = {"content": []} if self._chat else self._format_logprobs([])
            whole: dict[str, Any] = {**empty, **self._logprobs}
            if self._chat:
                whole["refusal"] = None
            logprobs = whole
        choice: dict[str, Any] = {"index": 0}
        if self._chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = self._finish_reason
        whole = self._envelope(self._object("whole"), [choice], usage=usage_dict(self._usage))
        return self._add_timings(whole)

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

    def _completion_parts(self, delta: GenerateDelta) -> tuple[str, dict[str, list[Any]] | None]:
        """A completions delta's text and logprobs, led by the prompt's on the first one
        when the request echoes."""
        echo, self._echo_pending = self._echo_pending, False
        text = self._prompt_text + delta.text if echo else delta.text
        if not self._req.logprobs:
            return text, None
        if not echo:
            return text, self._format_logprobs(delta.logprobs)
        ids = delta.prompt_token_ids or []
        lps = delta.prompt_logprobs or []
        assert len(lps) == len(ids) - 1, "the prompt's logprobs come with the first token"
        prompt = self._format_logprobs([TokenLogprob(ids[0], 0.0, 0, []), *lps])
        prompt["token_logprobs"][0] = prompt["top_logprobs"][0] = None  # position 0 has none
        out = self._format_logprobs(delta.logprobs)
        return text, {key: prompt[key] + out[key] for key in out}

    def _format_logprobs(self, lps: list[TokenLogprob]) -> dict[str, list[Any]]:
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
            out["text_offset"].append(self._text_offset)
            self._text_offset += len(token)
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
