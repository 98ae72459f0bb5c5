"""gateway.text.stop_strings: matches across deltas, hold-back, truncation and the include flag."""

from __future__ import annotations

import random

import pytest

from gateway.text.stop_strings import StopStringMatcher


def run(stops: list[str], deltas: list[str], include: bool = False) -> tuple[str, str | None]:
    """Feed every delta; the emitted text and the stop string that ended it (or None)."""
    matcher = StopStringMatcher(stops, include_in_output=include)
    out = []
    for delta in deltas:
        result = matcher.feed(delta)
        out.append(result.text)
        if result.hit:
            return "".join(out), result.stop
    out.append(matcher.flush())
    return "".join(out), None


def test_match_split_across_deltas_truncates_before_it() -> None:
    matcher = StopStringMatcher(["STOP"])
    first = matcher.feed("Hello ST")
    assert (first.text, first.hit) == ("Hello ", False)
    assert matcher.held == "ST"
    second = matcher.feed("OP and more")
    assert (second.text, second.stop) == ("", "STOP")


def test_include_flag_keeps_the_stop_string() -> None:
    assert run(["STOP"], ["Hello ST", "OP and more"], include=True) == ("Hello STOP", "STOP")


def test_held_text_is_released_once_it_cannot_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("Hello ST").text == "Hello "
    assert matcher.feed("AY").text == "STAY"
    assert matcher.held == ""


def test_held_text_is_released_at_the_end() -> None:
    assert run(["STOP"], ["Hello S", "T"]) == ("Hello ST", None)


def test_first_completed_match_wins() -> None:
    # "lo w" completes before "world" does, though "world" is listed first.
    assert run(["world", "lo w"], ["Hello world"]) == ("Hel", "lo w")
    # Same end: the one that starts first (the longer) wins.
    assert run(["b", "ab"], ["xab"]) == ("x", "ab")


def test_match_inside_one_delta_and_at_the_very_start() -> None:
    assert run(["\n\n"], ["line one\n\nline two"]) == ("line one", "\n\n")
    assert run(["END"], ["END of it"]) == ("", "END")


def test_check_false_holds_but_does_not_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a STOP b", check=False).text == "a STOP b"
    assert matcher.feed("ST", check=False).text == ""
    result = matcher.feed("OP")
    assert (result.text, result.stop) == ("", "STOP")


def test_no_stop_strings_pass_everything_through() -> None:
    matcher = StopStringMatcher([])
    assert not matcher.active
    assert matcher.feed("anything").text == "anything"
    assert matcher.flush() == ""


def test_feed_after_a_hit_is_an_error() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("x").hit
    with pytest.raises(RuntimeError):
        matcher.feed("more")


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(30))
def test_any_split_gives_the_same_result_as_the_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab \n日"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    ends = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if ends:
        end, start, stop = min(ends)
        expected: tuple[str, str | None] = (text[:start], stop)
    else:
        expected = (text, None)
    assert run(stops, deltas) == expected
