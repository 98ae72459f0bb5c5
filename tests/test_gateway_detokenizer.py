"""gateway.text.detokenizer with the real SmolLM2 tokenizer: split characters, context, specials."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from engine.model_files import ModelFiles
from gateway.text.detokenizer import MAX_HELD_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer
from gateway.text.tokenizer import Tokenizer

IM_END = 2  # <|im_end|>, a special token in SmolLM2's vocabulary

TEXTS = [
    "héllo 日本語 🎉 ok",
    "family: 👩‍👩‍👧, flags 🇫🇷🇯🇵",
    "Ünïcödé ∑∫√ — “quotes” and ‘more’",
    "    def f(x):\n\treturn x  # two  spaces",
    "plain ascii, nothing special.",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2: ModelFiles) -> Iterator[Tokenizer]:
    tok = Tokenizer.load(smollm2.path)
    yield tok
    tok.close()


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer._encode(text, False)


def stream(
    tokenizer: Tokenizer,
    output: Sequence[int],
    prompt: Sequence[int] = (),
    skip_special_tokens: bool = True,
) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(t) for t in output]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_whole_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = ids_of(tokenizer, text)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_multibyte_character_split_across_tokens_is_held_then_emitted(
    tokenizer: Tokenizer,
) -> None:
    ids = ids_of(tokenizer, "日本")
    pieces = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    assert any(REPLACEMENT_CHAR in p for p in pieces), "the test needs a split character"
    deltas = stream(tokenizer, ids)
    assert "" in deltas[:-1]  # held while incomplete
    assert "".join(deltas) == "日本"


def test_first_output_token_is_rendered_in_prompt_context(tokenizer: Tokenizer) -> None:
    prompt = ids_of(tokenizer, "Say hello:")
    whole = ids_of(tokenizer, "Say hello: Hello there, 世界!")
    assert whole[: len(prompt)] == prompt
    output = whole[len(prompt) :]
    expected = tokenizer.decode(whole, skip_special_tokens=True)[len("Say hello:") :]
    assert "".join(stream(tokenizer, output, prompt)) == expected


def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    output = [*ids_of(tokenizer, "Hi there"), IM_END]
    assert "".join(stream(tokenizer, output)) == "Hi there"
    assert "".join(stream(tokenizer, output, skip_special_tokens=False)) == "Hi there<|im_end|>"


def test_incomplete_character_at_the_end_is_flushed(tokenizer: Tokenizer) -> None:
    ids = ids_of(tokenizer, "日")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids[0]) == ""
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.flush() == ""


class GarbageDecoder:
    """Every token decodes to one replacement character: it never completes."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return REPLACEMENT_CHAR * len(token_ids)


def test_output_that_never_completes_is_released_after_a_bound() -> None:
    detok = IncrementalDetokenizer(GarbageDecoder(), [])
    deltas = [detok.add(i) for i in range(MAX_HELD_TOKENS)]
    assert deltas[:-1] == [""] * (MAX_HELD_TOKENS - 1)
    assert deltas[-1] == REPLACEMENT_CHAR * MAX_HELD_TOKENS
    assert detok.add(0) == ""
    assert detok.num_output_tokens == MAX_HELD_TOKENS + 1
