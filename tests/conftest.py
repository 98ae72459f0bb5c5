"""Shared pytest fixtures: tiny random models (built once per session) and the real SmolLM2.

Builders live in ``tests/factories.py``; fixtures here only cache their results.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors only under Triton's interpreter, chosen when a kernel
# is defined: set it before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.model_files import ModelFiles, resolve_model
from gateway.served_model import ServedModel, locate_model, read_model_card
from gateway.text.tokenizer import Tokenizer
from tests.factories import make_tiny_model_dir


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2() -> ModelFiles:
    """The bundled SmolLM2-135M-Instruct, converted once into the user cache."""
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2: ModelFiles) -> Path:
    """A tiny random Llama that shares SmolLM2's tokenizer and vocabulary."""
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-llama"), arch="llama", tokenizer_from=smollm2.path
    )


@pytest.fixture(scope="session")
def served_smollm2(smollm2: ModelFiles) -> Iterator[ServedModel]:
    """SmolLM2 as the gateway sees it (card and tokenizer, loaded once), for gateways
    built in the test process."""
    source = locate_model("smollm2-135m")
    tokenizer = Tokenizer.load(source.directory)
    yield ServedModel.from_loaded(source, tokenizer, read_model_card(source, tokenizer))
    tokenizer.close()
