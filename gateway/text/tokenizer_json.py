"""A checkpoint's tokenizer read straight from its ``tokenizer.json``, without transformers.

transformers' ``AutoTokenizer`` imports torch and transformers itself, then builds the same
Rust tokenizer out of ``tokenizer.json``: a gateway spent 6.8 CPU seconds from its start
to its model being ready, 0.9 without them (SmolLM2-135M, 2-CPU AVX2 host,
``benchmarks/results/startup_ab_2026-12-07_avx2_gateway-and-fork.md``), and has no torch
in its memory.

Only checkpoints whose tokenizer transformers loads as that file and nothing more take
this path: the generic class (``TokenizersBackend`` / ``PreTrainedTokenizerFast``), every
special token already in the file, no truncation or padding in it, a post-processor, a
single chat template. Anything else (a model-specific class that rebuilds the tokenizer,
tokens that transformers would add, its Mistral regex repair for vocabularies over 100k)
is for transformers to load: :func:`why_not_plain` names the reason, and
``gateway.text.tokenizer`` falls back to ``AutoTokenizer``. Token ids, decoded text, the
special ids and the rendered chat are those of ``AutoTokenizer`` on the same files
(``tests/test_tokenizer_json.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.text.chat_template import ChatTemplate

# transformers' generic tokenizer classes: they wrap tokenizer.json as it is.
_PLAIN_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Named special tokens, in transformers' order (SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIALS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Above this many tokens transformers may rewrite the pre-tokenizer's regex (Mistral's fix).
_REGEX_REPAIR_VOCAB = 100_000
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's
    fields (``{"content": ...}``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def why_not_plain(directory: Path) -> str | None:
    """None when ``directory``'s tokenizer can be read from tokenizer.json alone with the
    result transformers would give; otherwise why not."""
    tokenizer_file, config_file = directory / TOKENIZER_FILE, directory / CONFIG_FILE
    if not tokenizer_file.is_file() or not config_file.is_file():
        return f"no {TOKENIZER_FILE} and {CONFIG_FILE}"
    config = _read_json(config_file)
    cls = config.get("tokenizer_class")
    if cls not in _PLAIN_CLASSES:
        return f"tokenizer_class {cls!r} is not one of {sorted(_PLAIN_CLASSES)}"
    if config.get("split_special_tokens"):
        return "split_special_tokens is set"
    if "add_prefix_space" in config:
        return "add_prefix_space is set"
    if (directory / TEMPLATE_DIR).is_dir() or not isinstance(config.get("chat_template", ""), str):
        return "more than one chat template"
    extra = set(config) - set(_NAMED_SPECIALS)
    custom = sorted(k for k in extra if k.endswith("_token") and _token_text(config[k]) is not None)
    if custom:
        return f"model-specific special tokens {custom}"
    spec = _read_json(tokenizer_file)
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "tokenizer.json sets truncation or padding"
    if spec.get("post_processor") is None:
        return "tokenizer.json has no post-processor"
    vocab = spec.get("model", {}).get("vocab")
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    if vocab is None:
        return f"{TOKENIZER_FILE} has no vocabulary in its model"
    if len(set(_vocab_ids(vocab)) | set(added.values())) > _REGEX_REPAIR_VOCAB:
        return f"vocabulary over {_REGEX_REPAIR_VOCAB} tokens"
    for _id, token in config.get("added_tokens_decoder", {}).items():
        text = _token_text(token)
        if text is None or added.get(text) != int(_id):
            return f"added token {_id} of {CONFIG_FILE} is not in {TOKENIZER_FILE} as such"
    specials = [_token_text(config.get(k)) for k in _NAMED_SPECIALS if config.get(k) is not None]
    specials += [_token_text(t) for t in _extra_specials(config)]
    missing = [t for t in specials if t is None or t not in added]
    if missing:
        return f"special tokens {missing} are not added tokens of {TOKENIZER_FILE}"
    return None


def _vocab_ids(vocab: Any) -> list[int]:
    if isinstance(vocab, dict):
        return [int(i) for i in vocab.values()]
    return list(range(len(vocab)))  # Unigram: a list of [piece, score]


def _extra_specials(config: dict[str, Any]) -> list[Any]:
    # transformers 5 reads additional_special_tokens when extra_special_tokens is empty.
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    return list(extra.values()) if isinstance(extra, dict) else list(extra)


class TokenizerJson:
    """A ``tokenizers.Tokenizer`` and what tokenizer_config.json says of it. Build it with
    :meth:`load` after :func:`why_not_plain` said yes."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        config = _read_json(directory / CONFIG_FILE)
        self._rust = RustTokenizer.from_file(str(directory / TOKENIZER_FILE))
        self._rust.no_truncation()
        self._rust.no_padding()
        named = {k: _token_text(config[k]) for k in _NAMED_SPECIALS if config.get(k) is not None}
        self.special_tokens: dict[str, str] = {k: v for k, v in named.items() if v is not None}
        ordered = [
            *self.special_tokens.values(),
            *(_token_text(t) for t in _extra_specials(config)),
        ]
        ids = [self._id(t) for t in dict.fromkeys(t for t in ordered if t is not None)]
        self.all_special_ids = frozenset(ids)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self._id(eos) if eos is not None else None
        template_file = directory / TEMPLATE_FILE
        # As in transformers, the template file wins over the config's chat_template.
        source = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else config.get("chat_template") or None
        )
        self.chat_template = ChatTemplate(source, self.special_tokens) if source else None

    def _id(self, token: str) -> int:
        token_id = self._rust.token_to_id(token)
        assert token_id is not None, f"{token!r} was checked to be an added token"
        return int(token_id)

    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render(self, messages: list[dict[str, str]]) -> str:
        """The conversation ending with the assistant's turn header."""
        assert self.chat_template is not None, "callers check has_chat_template first"
        return self.chat_template.render(messages, add_generation_prompt=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._rust.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(self._rust.decode(list(token_ids), skip_special_tokens=skip_special_tokens))
