"""Compiling constraints with llguidance: a ``Constraint`` -> grammar text, its check, and
matchers over one tokenizer.

``check_constraint`` needs no tokenizer, so the gateway refuses a bad schema, regex or
grammar before anything is queued; a worker checks again against its own tokenizer when
it first builds a matcher. Compile work is bounded by llguidance's parser limits (``LIMITS``:
lexer fuel, grammar size, Earley items per step), so a grammar too costly to compile or to
step is refused with an error, never left to block the engine.

``GrammarCompiler`` is one tokenizer's view (building it costs ~0.3 s for a 49k-token
vocabulary, so an engine makes one) and caches one fresh matcher per constraint: a
request's matcher is a ``deep_copy`` of it, so a schema is compiled once per
(constraint, tokenizer). Torch-free; llguidance drops the GIL while it compiles and fills
masks.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from engine.constraint import Constraint, ConstraintKind

# The compile and per-step bounds (llguidance's defaults, stated so they are ours to
# choose): 1M units of initial lexer fuel is ~20 ms of regex analysis, 200k per step ~15
# ms, 50k Earley items per step ~2.5 ms.
LIMITS = {
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_grammar_size": 500_000,
}
MAX_CACHED_GRAMMARS = 256
MAX_ERROR_CHARS = 400
# JSON as OpenAI's models write it (``{"a": 1, "b": [2, 3]}``), without free whitespace
# between tokens: a model may otherwise spend its whole budget on blanks inside a valid
# object. A schema's own ``x-guidance`` options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for ``constraint``; ValueError naming the problem when the
    spec does not even parse (a schema that is not JSON, a malformed GBNF grammar)."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(constraint.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS
        )
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if kind is ConstraintKind.CHOICE:
        # Lark string literals take JSON's escapes, so any choice text is one literal.
        alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    assert kind is ConstraintKind.GRAMMAR, kind
    spec = constraint.spec
    if "::=" in spec:  # GBNF (llama.cpp's, and what vLLM's xgrammar backend takes)
        try:
            spec = any_to_lark(spec)
        except Exception as exc:  # the converter raises plain Exceptions on bad input
            raise ValueError(f"grammar is not valid GBNF: {exc}") from exc
    return llguidance.LLMatcher.grammar_from_lark(spec)


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def check_constraint(constraint: Constraint) -> None:
    """Raise ValueError, starting with the constraint's field name, when ``constraint``
    does not compile (an invalid or unsupported schema keyword, a bad regex or grammar, or
    one past the compile limits). Cached, so a repeated schema is checked once."""
    try:
        grammar = grammar_text(constraint)
    except ValueError as exc:
        message = str(exc)
        if message.startswith(constraint.field):
            raise
        raise ValueError(f"{constraint.field}: {message}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=_limits()
    )
    if is_error:
        raise ValueError(f"{constraint.field} does not compile: {_first_line(messages)}")


def _first_line(messages: Sequence[str]) -> str:
    """llguidance's error on one line: its text lines, without the source excerpt it
    points into (lines of ``^`` marks and ``N | ...`` quotes)."""
    text = messages[0] if messages else ""
    lines = [ln.strip() for ln in text.splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith("^") and not re.match(r"\d+ \|", ln)]
    return " ".join(kept)[:MAX_ERROR_CHARS] or "unknown error"


class GrammarCompiler:
    """Matchers for constraints over one tokenizer; safe to call from any thread."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.vocab_size
        self._templates: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_hf(cls, hf_tokenizer: object, eos_token_ids: Sequence[int]) -> GrammarCompiler:
        """From an HF fast tokenizer; ``eos_token_ids``: the model's, which the mask allows
        once the constraint is complete."""
        import llguidance.hf

        eos = list(eos_token_ids) or None
        return cls(llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos))

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for ``constraint``; ValueError when it does not compile."""
        with self._lock:
            template = self._templates.get(constraint)
            if template is not None:
                self._templates.move_to_end(constraint)
                return template.deep_copy()
        check_constraint(constraint)
        template = llguidance.LLMatcher(
            self.tokenizer, grammar_text(constraint), log_level=0, limits=_limits()
        )
        if template.is_error():
            raise ValueError(
                f"{constraint.field} does not compile: {_first_line([template.get_error()])}"
            )
        with self._lock:
            self._templates[constraint] = template
            while len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template.deep_copy()
