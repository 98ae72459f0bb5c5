"""A chat conversation's turns, as the tokenizer renders them through the chat template.

Its own module so that the tokenizer (which renders turns) and gateway.validation (which
builds them from a request) both depend on it and not on each other: the served model
holds the tokenizer, and validation reads the served model's card.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One validated chat message."""

    role: str
    content: str
