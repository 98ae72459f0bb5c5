"""Rendering a model's Jinja chat template without transformers.

The template is untrusted code from the model's files, so it runs in Jinja's immutable
sandbox. The environment is the one Hugging Face renders templates in, so a template
renders here exactly as ``tokenizer.apply_chat_template(..., tokenize=False)`` renders it
(``tests/test_tokenizer_json.py`` compares the two): ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` block that
renders its body, a ``tojson`` that leaves non-ASCII and HTML characters alone,
``raise_exception``, ``strftime_now``, and ``dict``/``namespace`` that refuse
underscore-prefixed names. The special tokens (``bos_token``, ``eos_token``, ...) are
visible to the template by name, as there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's part of a turn
    (for training masks); rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` in a template, without the type itself (and its attributes)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace, "
            f"got {name!r}"
        )


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses names starting with ``_`` (dunders reach
    CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class ChatTemplate:
    """One compiled chat template and the special tokens it may name."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = _Dict()
        env.globals["namespace"] = _Namespace
        self.source = source
        self._template = env.from_string(source)
        self._special_tokens = dict(special_tokens)

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        """The conversation as text, ending with the assistant's turn header when
        ``add_generation_prompt``. Raises ``jinja2.TemplateError`` when the template
        refuses the conversation."""
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )
