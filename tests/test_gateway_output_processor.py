"""gateway.text.output_processor on a one-character-per-token decoder: stops, min_tokens, usage."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.request import FinishReason, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from gateway.text.output_processor import OutputProcessor, Usage


class CharDecoder:
    """Token id n is the character chr(n)."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return "".join(chr(t) for t in token_ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def processor(stop: Sequence[str] = (), include: bool = False, **params: int) -> OutputProcessor:
    return OutputProcessor(
        "r1",
        ids("prompt"),
        SamplingParams(**params),
        CharDecoder(),
        stop=stop,
        include_stop_str_in_output=include,
    )


def out(text: str, finish: FinishReason | None = None, cached: int = 0) -> RequestOutput:
    return RequestOutput("r1", ids(text), finish_reason=finish, num_cached_tokens=cached)


def test_stop_string_inside_a_delta_drops_the_tokens_after_it() -> None:
    p = processor(stop=["STOP"])
    first = p.process(out("ab S"))
    assert (first.text, first.token_ids, first.finished) == ("ab ", ids("ab S"), False)
    last = p.process(out("TOP and more"))
    assert last.stop_string == "STOP" and last.finished
    assert last.token_ids == ids("TOP")  # "P" completed it; " and more" is never shown
    assert last.text == ""
    assert last.usage == Usage(prompt_tokens=6, completion_tokens=7)
    with pytest.raises(RuntimeError):
        p.process(out("x"))


def test_include_stop_string() -> None:
    last = processor(stop=["\n"], include=True).process(out("line\nnext"))
    assert (last.text, last.stop_string) == ("line\n", "\n")


def test_stop_strings_wait_for_min_tokens() -> None:
    p = processor(stop=["a"], min_tokens=3, max_tokens=10)
    first = p.process(out("aa"))
    assert (first.text, first.finished) == ("aa", False)
    last = p.process(out("bab"))
    assert (last.text, last.stop_string) == ("b", "a")


def test_natural_finish_flushes_held_text_and_reports_decode_finish() -> None:
    p = processor(stop=["STOP"])
    assert p.process(out("end ST")).text == "end "
    last = p.process(out("!", finish=FinishReason.LENGTH, cached=4))
    assert (last.text, last.finish_reason, last.stop_string) == ("ST!", FinishReason.LENGTH, None)
    assert last.usage == Usage(prompt_tokens=6, completion_tokens=7, cached_tokens=4)


def test_logprobs_follow_their_tokens() -> None:
    lps = [TokenLogprob(token_id=t, logprob=-1.0, rank=1, top=[]) for t in ids("xyz")]
    p = processor(stop=["y"])
    delta = p.process(RequestOutput("r1", ids("xyz"), logprobs=lps))
    assert delta.token_ids == ids("xy")
    assert [lp.token_id for lp in delta.logprobs] == ids("xy")
