"""The multi-turn chat workload of issue 20: conversations in groups that share a system
prompt, each a fixed number of user turns, every turn's reply a fixed number of tokens.

Deterministic from its seed. The text is English-ish, words drawn from a fixed list into
sentences, and cut so that it tokenizes (with the served model's own tokenizer) to the
drawn length: a system prompt of ``system_tokens`` per group, user turns of
``user_tokens``, each turn's ``max_tokens`` in ``reply_tokens`` (sent with EOS ignored,
so every server produces exactly that many). Conversation ``i`` starts at ``i / rate``
seconds; its next turn is sent when the previous reply has arrived (the driver's job).
Nothing here talks to a server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_WORDS = """
the of and to in is for that on with as are this be by from at it an or have which not
can will more all one has their they been about other time some system model data
request server token cache memory block worker engine result value first new each
number answer question report table review plan design measure order team project city
river market school garden window morning evening season weather letter message story
history music language science water energy light sound paper stone forest mountain
island bridge station harbour village country family friend teacher student doctor
customer manager engineer writer reader player farmer builder painter careful quiet
bright simple early late open close quick slow strong gentle clear short long small
large warm cold green blue golden silver ancient modern local public private useful
write read send keep find choose build carry follow bring explain describe compare
remember notice improve prepare measure return arrive travel gather listen suggest
because while after before during under over between through across against without
""".split()


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn: its text, its length in tokens, and the reply length asked."""

    user: str
    user_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation: its group's system prompt, its turns, and when it starts."""

    conversation_id: str
    group: int
    system: str
    system_tokens: int
    turns: tuple[Turn, ...]
    start_s: float


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    conversations: int = 32
    turns: int = 4
    group_size: int = 4  # conversations per shared system prompt
    system_tokens: tuple[int, int] = (1000, 2000)  # inclusive range
    user_tokens: tuple[int, int] = (50, 200)
    reply_tokens: tuple[int, int] = (64, 128)
    rate: float = 0.5  # conversations started per second
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "user_tokens", "reply_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 conversations/s, got {self.rate}")


def _sentences(rng: random.Random, min_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < min_chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
        sentence = " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!"))
        out.append(sentence)
        size += len(sentence) + 1
    return " ".join(out)


def text_of_tokens(tokenizer: Any, rng: random.Random, n: int) -> tuple[str, int]:
    """English-ish text that ``tokenizer`` (a ``tokenizers.Tokenizer``) encodes to ``n``
    tokens, cut at a token boundary; returns it and its measured length (``n``, or one
    off where the cut merges with its neighbour)."""
    text = _sentences(rng, 8 * n)  # words here run 1-2 tokens, ~6 chars each
    enc = tokenizer.encode(text, add_special_tokens=False)
    assert len(enc.ids) >= n, "the draft text is long enough by construction"
    cut = text[: enc.offsets[n - 1][1]]
    return cut, len(tokenizer.encode(cut, add_special_tokens=False).ids)


def load_tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def build(spec: WorkloadSpec, tokenizer: Any) -> list[Conversation]:
    """The conversations of ``spec``, the same ones for the same seed and tokenizer."""
    rng = random.Random(spec.seed)
    systems: dict[int, tuple[str, int]] = {}
    conversations = []
    for i in range(spec.conversations):
        group = i // spec.group_size
        if group not in systems:
            systems[group] = text_of_tokens(tokenizer, rng, rng.randint(*spec.system_tokens))
        turns = []
        for _ in range(spec.turns):
            user, n = text_of_tokens(tokenizer, rng, rng.randint(*spec.user_tokens))
            turns.append(Turn(user, n, rng.randint(*spec.reply_tokens)))
        system, system_tokens = systems[group]
        conversations.append(
            Conversation(f"c{i}", group, system, system_tokens, tuple(turns), i / spec.rate)
        )
    return conversations


def describe(conversations: list[Conversation]) -> dict[str, Any]:
    """The workload's measured sizes, for the report."""
    systems = {c.group: c.system_tokens for c in conversations}
    users = [t.user_tokens for c in conversations for t in c.turns]
    replies = [t.max_tokens for c in conversations for t in c.turns]
    return {
        "conversations": len(conversations),
        "turns": sum(len(c.turns) for c in conversations),
        "groups": len(systems),
        "system_tokens": [min(systems.values()), max(systems.values())],
        "user_tokens": [min(users), max(users)],
        "reply_tokens": [min(replies), max(replies)],
        "output_tokens": sum(replies),
    }
