"""Replays the multi-turn workload against an OpenAI-compatible server and reads its
Prometheus counters.

Neither ``vllm bench serve`` nor guidellm can send a conversation's next turn with the
reply the server actually gave, so this is the project's own driver: the official
``openai`` client streaming ``/v1/chat/completions``, one task per conversation, started
at its ``start_s``; each turn carries every earlier message, the assistant's replies as
they arrived, and asks for ``max_tokens`` with EOS ignored. The metrics are
``benchmarks.openai_load``'s (vLLM's definitions): TTFT is the request sent to the first
chunk with content, ITL the gaps between later content chunks, output tokens from the
usage chunk; a failed turn ends its conversation and counts as failed.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from benchmarks.multi_turn_workload import Conversation
from benchmarks.openai_load import Outcome


@dataclass(slots=True)
class TurnOutcome:
    """One turn as the client saw it; ``outcome`` in ``openai_load``'s terms."""

    conversation_id: str
    turn: int  # 0: the conversation's first
    request_id: str
    outcome: Outcome = field(default_factory=Outcome)


async def _turn(
    client: Any, model: str, messages: list[dict[str, str]], max_tokens: int, rid: str
) -> tuple[Outcome, str]:
    out, parts = Outcome(), []
    started = time.perf_counter()
    last = started
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": rid},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                content = chunk.choices[0].delta.content
                if not content:
                    continue  # the role-only first chunk, or a token still mid-character
                parts.append(content)
                if out.ttft == 0.0:
                    out.ttft = now - started
                else:
                    out.itl.append(now - last)
                last = now
            elif chunk.usage is not None:
                out.output_tokens = chunk.usage.completion_tokens
                out.prompt_len = chunk.usage.prompt_tokens
        out.latency = last - started
        if out.output_tokens != max_tokens:
            out.error = f"asked for {max_tokens} tokens, got {out.output_tokens}"
    except Exception as exc:  # a failed turn, counted as such
        out.error = f"{type(exc).__name__}: {exc}"
    return out, "".join(parts)


async def _conversation(
    client: Any, model: str, conv: Conversation, t0: float, prefix: str
) -> list[TurnOutcome]:
    await asyncio.sleep(max(0.0, t0 + conv.start_s - time.perf_counter()))
    messages = [{"role": "system", "content": conv.system}]
    done = []
    for i, turn in enumerate(conv.turns):
        messages.append({"role": "user", "content": turn.user})
        rid = f"{prefix}{conv.conversation_id}-t{i}"
        outcome, reply = await _turn(client, model, messages, turn.max_tokens, rid)
        done.append(TurnOutcome(conv.conversation_id, i, rid, outcome))
        if not outcome.success:
            break
        messages.append({"role": "assistant", "content": reply})
    return done


async def drive(
    base_url: str, model: str, conversations: list[Conversation], prefix: str
) -> tuple[list[TurnOutcome], float]:
    """Every conversation's turns, and the wall time from the first start to the last
    reply's end."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key="-", max_retries=0, timeout=3600
    )
    async with client:
        t0 = time.perf_counter()
        per = await asyncio.gather(
            *(_conversation(client, model, c, t0, prefix) for c in conversations)
        )
        duration = time.perf_counter() - t0
    return [t for turns in per for t in turns], duration


async def warm_up(base_url: str, model: str, text: str) -> None:
    """One short request outside the measurement (kernels built, pools touched)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="-", timeout=600)
    async with client:
        outcome, _ = await _turn(client, model, [{"role": "user", "content": text}], 8, "warmup")
    if not outcome.success:
        raise RuntimeError(f"the warm-up request failed: {outcome.error}")


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``http://address/metrics``: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:  # fmt: skip
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all((k, x) in ls for k, x in labels.items())
    )
