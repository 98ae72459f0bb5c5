"""The model's tokenizer at the gateway: text and chat in, token ids out, off the event loop.

Encoding a long prompt or rendering a chat template takes milliseconds to seconds, so
``encode`` and ``apply_chat_template`` run on one dedicated thread (HF fast tokenizers are
not safe to drive from several threads at once). ``decode`` stays synchronous: the
incremental detokenizer calls it on windows of a few tokens, which costs microseconds.

A checkpoint whose tokenizer is its tokenizer.json and nothing more is read without
transformers (``gateway.text.tokenizer_json``: no torch in the gateway, a start seconds
shorter); any other, and a GGUF file's, through transformers' ``AutoTokenizer``. Both give
the same ids, text and chat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jinja2 import TemplateError

from gateway.text.tokenizer_json import TokenizerJson, why_not_plain

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gateway.text.chat import ChatTurn

logger = logging.getLogger(__name__)


class _Backend(Protocol):
    """What the gateway asks of a tokenizer, whichever library holds it."""

    eos_token_id: int | None
    all_special_ids: frozenset[int]

    def has_chat_template(self) -> bool: ...

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str: ...

    def render(self, messages: list[dict[str, str]]) -> str: ...


class _Transformers:
    """A tokenizer loaded by transformers' ``AutoTokenizer``."""

    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        self._hf = hf
        self.eos_token_id: int | None = hf.eos_token_id
        self.all_special_ids = frozenset(hf.all_special_ids)

    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        text = self._hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str), "decoding one sequence gives one text"
        return text

    def render(self, messages: list[dict[str, str]]) -> str:
        rendered = self._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        if not isinstance(rendered, str):
            raise TypeError(f"chat template rendered a {type(rendered).__name__}, not text")
        return rendered


class Tokenizer:
    """A model's tokenizer plus the thread that runs it. ``close`` may be called twice."""

    def __init__(self, backend: _Backend, name: str) -> None:
        self.name = name
        self._backend = backend
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    @classmethod
    def load(cls, directory: Path, gguf_file: str | None = None) -> Tokenizer:
        """Read the tokenizer of a checkpoint directory, or of ``gguf_file`` inside it.

        Blocking. Reads tokenizer files or GGUF metadata only, never weights.
        """
        directory = Path(directory)
        name = gguf_file or directory.name
        reason = "a GGUF file" if gguf_file is not None else why_not_plain(directory)
        if reason is None:
            return cls(TokenizerJson(directory), name)
        logger.info("tokenizer of %s: loading through transformers (%s)", name, reason)
        from transformers import AutoTokenizer

        if gguf_file is None:
            hf = AutoTokenizer.from_pretrained(directory)
        else:
            hf = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        return cls(_Transformers(hf), name)

    @property
    def has_chat_template(self) -> bool:
        return self._backend.has_chat_template()

    @property
    def eos_token_id(self) -> int | None:
        return self._backend.eos_token_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._backend.all_special_ids

    async def encode(self, text: str) -> list[int]:
        """Token ids of plain text, with the model's usual special tokens (BOS, if any)."""
        return await self._run(self._encode, text, True)

    async def apply_chat_template(self, messages: Sequence[ChatTurn]) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template, ending with the
        prompt for the assistant's turn. Raises ValueError naming ``chat`` when the model
        has no template or the template rejects the conversation."""
        if not self.has_chat_template:
            raise ValueError(
                f"chat: model {self.name} has no chat template; send text or token_ids instead"
            )
        rendered = await self._run(
            self._render, [{"role": m.role, "content": m.content} for m in messages]
        )
        # The template writes BOS and turn markers itself; adding them again would double them.
        return await self._run(self._encode, rendered, False)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        """Text of ``token_ids`` exactly as the tokenizer renders it (no space clean-up)."""
        return self._backend.decode(token_ids, skip_special_tokens)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._backend.encode(text, add_special_tokens)

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self._backend.render(messages)
        except TemplateError as err:
            raise ValueError(
                f"chat: the model's chat template rejected the messages: {err}"
            ) from err

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)
