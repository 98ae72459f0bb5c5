"""gateway.text.tokenizer_json and chat_template: the tokenizer without transformers gives
what transformers' AutoTokenizer gives on the same files, and other tokenizers go to it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest

from engine.model_files import ModelFiles
from gateway.text.chat_template import ChatTemplate
from gateway.text.tokenizer import Tokenizer
from gateway.text.tokenizer_json import TokenizerJson, why_not_plain

TEXTS = [
    "",
    "Hello world",
    " leading space and trailing space ",
    "What is 2+2?\nAnswer:",
    "tabs\tand\r\nwindows newlines\n\n\n",
    "ünïcödé — em dash, “quotes”, 日本語のテキスト, emoji 🤖👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special tokens inside words: a<|im_end|>b <|endoftext|>c",
    "<script>alert('x') & \"y\"</script>",
    "    def f(x):\n        return x ** 2  # code\n",
    "1234567890 3.14159 -42 1e-9",
    "a" * 300,
]

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "ünïcödé <b>&</b>"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again <|im_end|>"},
    ],
]

# Templates exercising each part of the environment transformers renders in.
TEMPLATES = {
    "whitespace": (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "U: {{ m.content }}\n"
        "    {% else %}\n"
        "A: {{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}A:{% endif %}"
    ),
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
    "loop_controls": (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.content }}]{% endfor %}"
    ),
    "generation": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "<a>{{ m.content }}</a>{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}"
        "{% endfor %}"
    ),
    "namespace_and_dict": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{% set d = dict(a=1, b='x') %}{{ ns.n }}-{{ d.b }}-{{ d | tojson }}"
    ),
    "special_tokens": "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|"
    "{{ messages[-1].content }}{{ eos_token }}",
    "strftime": "{{ strftime_now('%Y') }}",
    "tools_and_documents": "{{ tools is none }} {{ documents is none }}",
    "undefined_variable": "{{ not_defined }}x{{ messages[0].missing }}y",
}

REFUSING_TEMPLATES = {
    "raise_exception": (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant, got ' + m.role) }}"
        "{% endif %}{% endfor %}"
    ),
    "underscore_namespace": "{% set ns = namespace(_x=1) %}{{ ns._x }}",
    "underscore_assignment": "{% set ns = namespace() %}{% set ns._y = 2 %}",
    "unsafe_attribute": "{{ messages.__class__.__mro__ }}",
    "mutation": "{% set _ = messages.append({'role': 'x'}) %}",
}


@pytest.fixture(scope="module")
def hf(smollm2: ModelFiles) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.path)


@pytest.fixture(scope="module")
def plain(smollm2: ModelFiles) -> TokenizerJson:
    assert why_not_plain(smollm2.path) is None
    return TokenizerJson(smollm2.path)


def test_the_bundled_model_loads_without_transformers_or_torch(smollm2: ModelFiles) -> None:
    code = (
        "import sys; from pathlib import Path; from gateway.text.tokenizer import Tokenizer; "
        f"t = Tokenizer.load(Path({str(smollm2.path)!r})); "
        "assert type(t._backend).__name__ == 'TokenizerJson', t._backend; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encoding_equals_transformers(
    hf: Any, plain: TokenizerJson, add_special_tokens: bool
) -> None:
    for text in TEXTS:
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert plain.encode(text, add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decoding_equals_transformers(
    hf: Any, plain: TokenizerJson, skip_special_tokens: bool
) -> None:
    sequences = [hf.encode(t, add_special_tokens=False) for t in TEXTS]
    # Ids that are not a tokenization of any text: partial UTF-8, specials between words.
    sequences += [[0, 1, 2, 3, 4, 5], [1, 28120, 2, 905, 0], [94], [137, 94], list(range(40, 90))]
    for ids in sequences:
        expected = hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert plain.decode(ids, skip_special_tokens) == expected, ids


def test_special_ids_equal_transformers(hf: Any, plain: TokenizerJson) -> None:
    assert plain.eos_token_id == hf.eos_token_id
    assert plain.all_special_ids == frozenset(hf.all_special_ids)
    assert plain.special_tokens == hf.special_tokens_map


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_the_models_chat_renders_as_in_transformers(
    hf: Any, plain: TokenizerJson, chat: list[dict[str, str]]
) -> None:
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert plain.chat_template is not None
    assert plain.chat_template.render(chat, add_generation_prompt=True) == expected


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_template_feature_renders_as_in_transformers(
    hf: Any, plain: TokenizerJson, name: str
) -> None:
    ours = ChatTemplate(TEMPLATES[name], plain.special_tokens)
    for chat in CHATS:
        for prompt in (True, False):
            expected = hf.apply_chat_template(
                chat, chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=prompt
            )
            assert ours.render(chat, add_generation_prompt=prompt) == expected


@pytest.mark.parametrize("name", sorted(REFUSING_TEMPLATES))
def test_templates_transformers_refuses_are_refused(
    hf: Any, plain: TokenizerJson, name: str
) -> None:
    chat = CHATS[1]
    with pytest.raises(jinja2.TemplateError) as theirs:
        hf.apply_chat_template(
            chat, chat_template=REFUSING_TEMPLATES[name], tokenize=False, add_generation_prompt=True
        )
    with pytest.raises(jinja2.TemplateError) as ours:
        ChatTemplate(REFUSING_TEMPLATES[name], plain.special_tokens).render(
            chat, add_generation_prompt=True
        )
    assert type(ours.value) is type(theirs.value)
    if name == "raise_exception":
        assert str(ours.value) == str(theirs.value) == "roles must be user or assistant, got system"


async def test_a_refusing_template_is_a_chat_error(smollm2: ModelFiles, tmp_path: Path) -> None:
    directory = _copy_tokenizer(smollm2.path, tmp_path)
    (directory / "chat_template.jinja").write_text(REFUSING_TEMPLATES["raise_exception"])
    tokenizer = Tokenizer.load(directory)
    try:
        from gateway.text.chat import ChatTurn

        with pytest.raises(ValueError, match="^chat: the model's chat template rejected"):
            await tokenizer.apply_chat_template([ChatTurn("system", "x"), ChatTurn("user", "y")])
    finally:
        tokenizer.close()


def _copy_tokenizer(source: Path, dest: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    return dest


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tokenizer(directory: Path, **changes: Any) -> None:
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec.update(changes)
    path.write_text(json.dumps(spec))


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (
            lambda d: _edit_config(d, tokenizer_class="GPT2Tokenizer"),
            "tokenizer_class 'GPT2Tokenizer'",
        ),
        (lambda d: _edit_config(d, bos_token="<s>"), r"special tokens \['<s>'\]"),
        (lambda d: _edit_config(d, additional_special_tokens=["<tool>"]), r"\['<tool>'\]"),
        (lambda d: _edit_config(d, image_token="<|im_start|>"), "model-specific special tokens"),
        (lambda d: _edit_config(d, split_special_tokens=True), "split_special_tokens"),
        (lambda d: _edit_config(d, add_prefix_space=True), "add_prefix_space"),
        (
            lambda d: _edit_config(d, chat_template=[{"name": "a", "template": "x"}]),
            "more than one",
        ),
        (lambda d: _edit_tokenizer(d, post_processor=None), "no post-processor"),
        (
            lambda d: _edit_tokenizer(
                d,
                truncation={
                    "direction": "Right",
                    "max_length": 8,
                    "strategy": "LongestFirst",
                    "stride": 0,
                },
            ),
            "truncation or padding",
        ),
        (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
    ],
    ids=[
        "model-class",
        "missing-special",
        "missing-extra",
        "model-specific-token",
        "split-specials",
        "prefix-space",
        "several-templates",
        "no-post-processor",
        "truncation",
        "no-file",
    ],
)
def test_what_transformers_would_change_goes_through_transformers(
    smollm2: ModelFiles, tmp_path: Path, edit: Any, reason: str
) -> None:
    directory = _copy_tokenizer(smollm2.path, tmp_path)
    edit(directory)
    found = why_not_plain(directory)
    assert found is not None
    assert re.search(reason, found), found


def test_a_fallback_tokenizer_still_serves(smollm2: ModelFiles, tmp_path: Path) -> None:
    directory = _copy_tokenizer(smollm2.path, tmp_path)
    _edit_config(directory, tokenizer_class="GPT2Tokenizer")
    fallback, plain = Tokenizer.load(directory), Tokenizer.load(smollm2.path)
    try:
        assert type(fallback._backend).__name__ == "_Transformers"
        for text in TEXTS:
            assert fallback._encode(text, True) == plain._encode(text, True)
        assert fallback._render(CHATS[1]) == plain._render(CHATS[1])
        assert fallback.eos_token_id == plain.eos_token_id
    finally:
        fallback.close()
        plain.close()
