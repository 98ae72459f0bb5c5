"""gateway.served_model: locating metadata without converting, cards, and the tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.model_files import ModelFiles, find_bundled_gguf
from gateway.served_model import ServedModel, locate_model, read_model_card
from gateway.text.chat import ChatTurn
from gateway.text.tokenizer import Tokenizer


def test_bundled_name_uses_the_converted_checkpoint(smollm2: ModelFiles) -> None:
    source = locate_model("SmolLM2-135M-Instruct")
    assert (source.name, source.directory, source.gguf_file) == (
        "smollm2-135m",
        smollm2.path,
        None,
    )


def test_without_a_conversion_the_gguf_itself_is_read(tmp_path: Path) -> None:
    found = find_bundled_gguf("smollm2-135m")
    assert found is not None
    source = locate_model("smollm2-135m", cache_dir=tmp_path)
    assert source.is_gguf
    assert source.directory / str(source.gguf_file) == found[1]
    assert list(tmp_path.iterdir()) == []  # nothing converted, nothing created


def test_checkpoint_directory_and_unknown_model(smollm2: ModelFiles, tmp_path: Path) -> None:
    assert locate_model(str(smollm2.path)).directory == smollm2.path
    with pytest.raises(ValueError, match="model 'no-such-model'"):
        locate_model("no-such-model")
    with pytest.raises(ValueError, match="checkpoint directory"):
        locate_model(str(tmp_path))  # a directory without config.json


async def test_card_tokenizer_and_chat_template(smollm2: ModelFiles) -> None:
    model = ServedModel(locate_model(str(smollm2.path)), max_model_len=2048)
    assert not model.loaded
    await model.load()
    try:
        card = model.card
        assert (card.vocab_size, card.max_model_len, card.eos_token_ids) == (49152, 2048, (2,))
        assert card.has_chat_template
        assert await model.tokenizer.encode("hello world") == [28120, 905]
        ids = await model.tokenizer.apply_chat_template([ChatTurn("user", "hi")])
        rendered = model.tokenizer.decode(ids, skip_special_tokens=False)
        assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    finally:
        model.close()


def test_max_model_len_beyond_the_model_is_refused(smollm2: ModelFiles) -> None:
    source = locate_model(str(smollm2.path))
    tokenizer = Tokenizer.load(source.directory)
    try:
        with pytest.raises(ValueError, match="max_model_len 9000 exceeds"):
            read_model_card(source, tokenizer, max_model_len=9000)
    finally:
        tokenizer.close()


async def test_model_without_chat_template_refuses_chat(
    smollm2: ModelFiles, tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2.path / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.load(tmp_path)
    assert not tokenizer.has_chat_template
    try:
        with pytest.raises(ValueError, match="^chat: model .* has no chat template"):
            await tokenizer.apply_chat_template([ChatTurn("user", "hi")])
    finally:
        tokenizer.close()


@pytest.mark.slow
async def test_gguf_metadata_matches_the_converted_checkpoint(
    smollm2: ModelFiles, tmp_path: Path
) -> None:
    from_gguf = ServedModel(locate_model("smollm2-135m", cache_dir=tmp_path))
    converted = Tokenizer.load(smollm2.path)
    await from_gguf.load()
    try:
        assert from_gguf.card == read_model_card(locate_model("smollm2-135m"), converted)
        assert await from_gguf.tokenizer.encode("hello world") == [28120, 905]
    finally:
        from_gguf.close()
        converted.close()
