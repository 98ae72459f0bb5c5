"""What the gateway knows of the served model: its card and tokenizer, never its weights.

The gateway must start fast and stay small, so it reads only metadata. For a bundled model
or a ``.gguf`` path it uses the checkpoint directory the workers already converted when
there is one (a cheap read), and otherwise reads the tokenizer and config out of the GGUF
itself (``gguf_file=``), which parses metadata but converts no weights. A checkpoint
directory is read as it is.

Loading blocks for seconds, so :meth:`ServedModel.load` runs it on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UnavailableError
from engine.model_files import (
    ModelFiles,
    _fingerprint,  # the conversion cache key; shared so the two can never drift apart
    _safe_name,
    default_cache_dir,
    find_bundled_gguf,
    known_model_names,
    read_hf_config,
)
from engine.sampling_params import MAX_LOGPROBS
from gateway.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the model's metadata is read from: a checkpoint directory, or a GGUF in it."""

    name: str  # the model id reported to clients
    directory: Path
    gguf_file: str | None = None  # a file name inside ``directory``; None: HF checkpoint

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


@dataclass(frozen=True, slots=True)
class ModelCard:
    """The served model as clients see it (``ModelInfo``) and as validation checks it."""

    model_id: str
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_model_len: int  # prompt plus output, in tokens
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def locate_model(name_or_path: str, cache_dir: Path | None = None) -> ModelSource:
    """The metadata source for a bundled model name, a ``.gguf`` path or a checkpoint dir.

    Never converts anything. Raises ValueError naming ``model`` for anything unusable.
    """
    bundled = find_bundled_gguf(name_or_path)
    if bundled is not None:
        name, gguf_path = bundled
        return _gguf_source(name, gguf_path, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_source(_safe_name(path.stem), path.resolve(), cache_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=path.resolve().name, directory=path.resolve())
    raise ValueError(
        f"model {name_or_path!r} is not a bundled model ({', '.join(known_model_names())}), "
        "a .gguf file, or a checkpoint directory with a config.json"
    )


def _gguf_source(name: str, gguf_path: Path, cache_dir: Path | None) -> ModelSource:
    root = cache_dir if cache_dir is not None else default_cache_dir()
    converted = root / f"{name}-{_fingerprint(gguf_path)}"
    if (converted / "config.json").is_file():
        return ModelSource(name=name, directory=converted)
    logger.info("no converted checkpoint at %s; reading metadata from %s", converted, gguf_path)
    return ModelSource(name=name, directory=gguf_path.parent, gguf_file=gguf_path.name)


def read_model_card(source: ModelSource, tokenizer: Tokenizer, max_model_len: int = 0) -> ModelCard:
    """The card for ``source``. ``max_model_len`` 0 means the model's position limit.

    Blocking (reads config files, or parses GGUF metadata).
    """
    vocab_size, positions, eos_ids = _read_config(source)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    if max_model_len > positions:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {positions}"
        )
    return ModelCard(
        model_id=source.name,
        vocab_size=vocab_size,
        max_model_len=max_model_len or positions,
        eos_token_ids=tuple(eos_ids),
        has_chat_template=tokenizer.has_chat_template,
    )


def read_max_model_len(source: ModelSource, max_model_len: int = 0) -> int:
    """The context the gateway will serve, without loading the tokenizer: ``max_model_len``
    if set, else the model's position limit. Blocking (reads config files)."""
    return max_model_len or _read_config(source)[1]


def _read_config(source: ModelSource) -> tuple[int, int, list[int]]:
    """(vocab size, position limit, eos token ids) from the checkpoint's config."""
    if source.gguf_file is None:
        config = read_hf_config(ModelFiles(name=source.name, path=source.directory))
        return (
            int(config["vocab_size"]),
            int(config.get("max_position_embeddings", 2048)),
            [int(e) for e in config["eos_token_ids"]],
        )
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)
    eos = hf.eos_token_id
    eos_ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else list(eos)
    return int(hf.vocab_size), int(getattr(hf, "max_position_embeddings", 2048)), eos_ids


class ServedModel:
    """The card and tokenizer of one model, loaded once by :meth:`load`.

    Before ``load`` has finished, ``card`` and ``tokenizer`` raise UnavailableError (the
    server refuses calls until then anyway). ``load`` may be awaited more than once.
    """

    def __init__(self, source: ModelSource, max_model_len: int = 0) -> None:
        self.source = source
        self._max_model_len = max_model_len
        self._tokenizer: Tokenizer | None = None
        self._card: ModelCard | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def from_loaded(cls, source: ModelSource, tokenizer: Tokenizer, card: ModelCard) -> ServedModel:
        """Already loaded: for tests and tools that share one tokenizer."""
        model = cls(source)
        model._tokenizer, model._card = tokenizer, card
        return model

    @property
    def loaded(self) -> bool:
        return self._card is not None

    def max_model_len(self) -> int:
        """The context served: the card's once loaded; before, read from the config
        (blocking), for limits the server needs before it starts (message sizes)."""
        if self._card is not None:
            return self._card.max_model_len
        return read_max_model_len(self.source, self._max_model_len)

    @property
    def card(self) -> ModelCard:
        if self._card is None:
            raise UnavailableError(f"model {self.source.name} is still loading")
        return self._card

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise UnavailableError(f"model {self.source.name} is still loading")
        return self._tokenizer

    async def load(self) -> None:
        async with self._lock:
            if self._card is not None:
                return
            began = time.monotonic()
            tokenizer = await asyncio.to_thread(
                Tokenizer.load, self.source.directory, self.source.gguf_file
            )
            card = await asyncio.to_thread(
                read_model_card, self.source, tokenizer, self._max_model_len
            )
            self._tokenizer, self._card = tokenizer, card
            logger.info(
                "model %s ready in %.1fs: vocab %d, max_model_len %d, eos %s, chat template %s",
                card.model_id,
                time.monotonic() - began,
                card.vocab_size,
                card.max_model_len,
                list(card.eos_token_ids),
                "yes" if card.has_chat_template else "no",
            )

    def close(self) -> None:
        if self._tokenizer is not None:
            self._tokenizer.close()
