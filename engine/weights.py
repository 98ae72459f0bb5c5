"""Reading checkpoint tensors: one stream of ``(HF name, tensor)`` over a safetensors checkpoint.

Owns finding the weight files of a checkpoint directory (a single file, several files, or a
shard set listed in ``model.safetensors.index.json``) and reading them lazily, one tensor at a
time, so a loader never holds two copies of the model. Names are the checkpoint's own HF
names; a model with tied embeddings has no ``lm_head.weight`` here, and its loader ties it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of checkpoint directory ``path``, in a stable order.

    With an index file, exactly the shards it names (all must exist); otherwise every
    ``*.safetensors`` in the directory. Raises ValueError if there are none.
    """
    if not path.is_dir():
        raise ValueError(f"checkpoint path {str(path)!r} is not a directory")
    index = path / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{str(index)!r} names shards that do not exist: {missing}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint directory {str(path)!r} has no *.safetensors files")
    return files


def iter_safetensors(path: Path, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint in ``path`` as ``(name, tensor)``, on the CPU.

    Files are validated before the first tensor is read, so a bad path raises ValueError at
    the call, not at the first ``next()``. The progress bar (stderr) counts tensors.
    """
    files = safetensors_files(path)
    return _iter_files(files, show_progress)


def _iter_files(files: list[Path], show_progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    # Reading only the headers first gives the bar a true total; it costs one small read a file.
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            total += len(handle.keys())
    logger.info("loading %d tensors from %d file(s) in %s", total, len(files), files[0].parent)
    with tqdm(
        total=total,
        desc="loading weights",
        unit="tensor",
        disable=not show_progress,
        file=sys.stderr,
    ) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
                    bar.update(1)
