"""Fetching a model from the Hugging Face Hub into a volume, once, before any worker starts.

``python -m engine.model_fetch`` is the chart's init step for ``model.source: hf``: it
downloads ``--repo`` at ``--revision`` with ``huggingface_hub`` (the token from
``--token-file``, a mounted Secret; ``--endpoint``, else ``HF_ENDPOINT``, for a mirror or
a private hub) and leaves one HF checkpoint directory for every process of the pod to
load read-only::

    <dest>/<repo name>/       the checkpoint: config.json, tokenizer, *.safetensors
    <dest>/.gguf/             --gguf-file only: the downloaded .gguf
    <dest>/.fetch.lock        flock'ed by whoever fetches (pods sharing a volume)

A repo of safetensors is downloaded as it is. With ``--gguf-file`` only that file is
downloaded and converted once into the checkpoint directory (fp32 safetensors, by
``engine.model_files``), refused before writing when it cannot fit, with the sizes.

Once is per volume: a hostPath volume fetches once per node, a shared claim once per
claim, an emptyDir once per pod. A checkpoint already complete at a commit-hash revision
is used without touching the network; a branch or tag is resolved again (new files are
downloaded, present ones kept). ``--tokenizer-only`` (the gateway) skips the weights of a
safetensors repo.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine import model_files

logger = logging.getLogger(__name__)

_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Files a worker never loads: other weight formats and repo clutter.
_NOT_LOADED = ["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "original/*"]
_WEIGHTS = ["*.safetensors", "*.safetensors.index.json"]
# In a checkpoint converted from a GGUF: the fingerprint of that GGUF.
_CONVERTED_FROM = ".baton-converted-from"


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """What to fetch and where (built once by ``__main__`` or a test)."""

    repo: str
    dest: Path
    revision: str = "main"
    gguf_file: str = ""
    tokenizer_only: bool = False
    token_file: Path | None = None
    endpoint: str | None = None

    def __post_init__(self) -> None:
        if not _REPO.match(self.repo):
            raise ValueError(f"repo must be ORG/NAME, got {self.repo!r}")
        if not self.revision:
            raise ValueError("revision must not be empty (a commit hash pins it)")
        if self.gguf_file and (not self.gguf_file.endswith(".gguf") or ".." in self.gguf_file):
            raise ValueError(f"gguf_file must name a .gguf in the repo, got {self.gguf_file!r}")

    @property
    def checkpoint(self) -> Path:
        """The directory every process loads."""
        return self.dest / self.repo.split("/")[1]


def is_complete(checkpoint: Path, *, tokenizer_only: bool = False) -> bool:
    """Whether ``checkpoint`` has what a worker (or, tokenizer-only, the gateway) loads."""
    if not (checkpoint / "config.json").is_file():
        return False
    return tokenizer_only or any(checkpoint.glob("*.safetensors"))


def fetch(cfg: FetchConfig) -> Path:
    """The checkpoint directory of ``cfg``, downloaded (and converted) if it is not there."""
    cfg.dest.mkdir(parents=True, exist_ok=True)
    with open(cfg.dest / ".fetch.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            pinned = bool(_COMMIT.match(cfg.revision))
            if pinned and is_complete(cfg.checkpoint, tokenizer_only=cfg.tokenizer_only):
                logger.info("%s@%s already in %s", cfg.repo, cfg.revision, cfg.checkpoint)
                return cfg.checkpoint
            if cfg.gguf_file:
                _fetch_gguf(cfg)
            else:
                _download(
                    cfg,
                    cfg.checkpoint,
                    ignore=_NOT_LOADED + (_WEIGHTS if cfg.tokenizer_only else []),
                )
                if not is_complete(cfg.checkpoint, tokenizer_only=cfg.tokenizer_only):
                    what = "config.json" if cfg.tokenizer_only else "config.json and *.safetensors"
                    raise ValueError(
                        f"{cfg.repo}@{cfg.revision} has no {what}: baton loads HF safetensors "
                        "checkpoints (or give a .gguf of the repo with --gguf-file)"
                    )
            logger.info("%s@%s is in %s", cfg.repo, cfg.revision, cfg.checkpoint)
            return cfg.checkpoint
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _download(cfg: FetchConfig, local_dir: Path, *, ignore: list[str] | None = None,
              allow: list[str] | None = None) -> None:  # fmt: skip
    from huggingface_hub import snapshot_download

    token = cfg.token_file.read_text().strip() if cfg.token_file is not None else None
    snapshot_download(
        cfg.repo,
        revision=cfg.revision,
        local_dir=local_dir,
        endpoint=cfg.endpoint or None,
        token=token or None,
        allow_patterns=allow,
        ignore_patterns=ignore,
    )


def _fetch_gguf(cfg: FetchConfig) -> None:
    """Download the one .gguf, then convert it into the checkpoint directory (atomically)."""
    gguf_dir = cfg.dest / ".gguf"
    _download(cfg, gguf_dir, allow=[cfg.gguf_file])
    gguf_path = gguf_dir / cfg.gguf_file
    if not gguf_path.is_file():
        raise ValueError(f"{cfg.repo}@{cfg.revision} has no file {cfg.gguf_file!r}")
    final = cfg.checkpoint
    # The checkpoint records which GGUF it was converted from: a branch that still points
    # at the same file is not converted again by every pod that fetches it.
    source = model_files.gguf_fingerprint(gguf_path)
    marker = final / _CONVERTED_FROM
    if is_complete(final) and marker.is_file() and marker.read_text() == source:
        logger.info("%s is already converted in %s", cfg.gguf_file, final)
        return
    model_files.check_conversion_room(gguf_path, cfg.dest)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cfg.dest))
    try:
        model_files.convert_gguf(gguf_path, tmp)
        (tmp / _CONVERTED_FROM).write_text(source)
        if final.exists():
            shutil.rmtree(final)  # an earlier revision's, replaced under the lock
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {raw!r}")


def parse(argv: Sequence[str], env: Mapping[str, str]) -> FetchConfig:
    """Flags over their ``BATON_FETCH_*`` twins; ``--endpoint`` defaults to ``HF_ENDPOINT``."""
    p = argparse.ArgumentParser(
        prog="python -m engine.model_fetch",
        description="Download a Hugging Face model once into a volume (the chart's init step). "
        "Every flag can also be set as BATON_FETCH_<FLAG>.",
    )
    p.add_argument("--repo", help="ORG/NAME on the hub")
    p.add_argument("--revision", help="branch, tag or commit hash (default main)")
    p.add_argument("--dest", help="directory of the volume to fetch into")
    p.add_argument("--gguf-file", help="a .gguf of the repo: download it alone and convert it")
    p.add_argument("--tokenizer-only", help="skip the weights (the gateway): true/false")
    p.add_argument("--token-file", help="file holding the hub token (a mounted Secret)")
    p.add_argument("--endpoint", help="the hub's URL (default: HF_ENDPOINT, else huggingface.co)")
    args = p.parse_args(list(argv))

    def get(name: str) -> str | None:
        value = getattr(args, name)
        return value if value is not None else env.get(f"BATON_FETCH_{name.upper()}")

    repo, dest = get("repo"), get("dest")
    if not repo or not dest:
        raise ValueError("--repo and --dest are required")
    token_file = get("token_file")
    return FetchConfig(
        repo=repo,
        dest=Path(dest),
        revision=get("revision") or "main",
        gguf_file=get("gguf_file") or "",
        tokenizer_only=_bool(get("tokenizer_only") or ""),
        token_file=Path(token_file) if token_file else None,
        endpoint=get("endpoint") or env.get("HF_ENDPOINT") or None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv, os.environ)
        fetch(cfg)
    except ValueError as err:
        logger.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
