"""Incremental detokenization of one request's output, token by token.

Decoding each token on its own is wrong twice over: a multi-byte UTF-8 character split
across tokens decodes as U+FFFD, and tokenizers that merge or strip spaces (SentencePiece)
render a token differently at the start of a text than after others. So, as in vLLM and
TGI, the detokenizer keeps two offsets into the token ids::

    ids:  ... | prefix_offset ....... read_offset ....... end
                 \\__ already emitted __/ \\__ not yet __/

and on each new token decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``.
The new text is what the first has beyond the second. When it ends in U+FFFD the
character is not complete yet: nothing is emitted and the offsets stay, so the next token
completes it. Otherwise both offsets advance. A few prompt tokens seed the window, so
the first output token is rendered in context (its leading space survives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so it is complete within 4 tokens; past this many
# held tokens the U+FFFD is in the model's output itself, and holding on would only make
# every later decode longer.
MAX_HELD_TOKENS = 8


class Decoder(Protocol):
    """The one tokenizer call the detokenizer needs (gateway.text.tokenizer.Tokenizer has it)."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas. Not thread-safe; one per request.

    ``add`` returns the text that the new tokens complete (maybe ""), ``flush`` whatever
    is still held back at the end of the stream (an incomplete character, as U+FFFD).
    The concatenation of every delta equals decoding the whole output at once.
    """

    def __init__(
        self,
        decoder: Decoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = decoder
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.num_output_tokens = 0

    def add(self, token_id: int) -> str:
        """The text completed by ``token_id`` (often one token's worth; "" when held)."""
        self._ids.append(token_id)
        self.num_output_tokens += 1
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end); then "" ever after."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        window = self._ids[self._prefix_offset :]
        seen = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:seen])
        new_text = self._decode(window)
        held = len(self._ids) - self._read_offset
        if not final and new_text.endswith(REPLACEMENT_CHAR) and held < MAX_HELD_TOKENS:
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special)
