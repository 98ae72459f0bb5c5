"""Regenerate the committed Python modules from ``protos/baton/v1/*.proto``.

Run from the repository root: ``python -m protos.generate``. protoc runs with ``-I.`` at
the root, so generated imports read ``from protos.baton.v1 import common_pb2``. It writes
``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` next to each ``.proto``; the freshness
test (``tests/test_protos_fresh.py``) calls :func:`generate` into a temporary root and
compares byte for byte.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos") / "baton" / "v1"
REGENERATE_COMMAND = "python -m protos.generate"


def proto_files() -> list[Path]:
    """The ``.proto`` files, relative to the repository root, in a stable order."""
    return sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / PROTO_DIR).glob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """The generated modules under ``root`` (relative to it), in a stable order."""
    out: list[Path] = []
    for pattern in ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py"):
        out.extend(p.relative_to(root) for p in (root / PROTO_DIR).glob(pattern))
    return sorted(out)


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Compile every proto into ``out_root`` (which mirrors the repository root).

    Runs ``python -m grpc_tools.protoc -I.`` in the repository root, in a subprocess so
    the caller's working directory is untouched. Returns the generated paths relative to
    ``out_root``. Raises RuntimeError when protoc fails.
    """
    protos = proto_files()
    if not protos:
        raise RuntimeError(f"no .proto files under {REPO_ROOT / PROTO_DIR}")
    out_root = out_root.resolve()
    (out_root / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I.",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(p.as_posix() for p in protos),
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"protoc failed with exit code {done.returncode}: {' '.join(cmd)}\n{done.stderr}"
        )
    return generated_files(out_root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="root to write into (default: the repository root)",
    )
    args = parser.parse_args(argv)
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
