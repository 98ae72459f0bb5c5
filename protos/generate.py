"""Regenerate the committed Python modules from ``protos/baton/v1/*.proto``.

Run from the repository root: ``python -m protos.generate``. ``protos/`` is the proto
root (see ``protos/buf.yaml``): protoc runs there with ``-I.``, so the protos import each
other as ``baton/v1/common.proto``, as any other language's generator sees them.

protoc then writes Python imports for a ``baton.v1`` package, but in this repository the
modules live at ``protos/baton/v1/`` and are imported as ``protos.baton.v1``; a top-level
``baton`` package would also clash with anything else of that name. So :func:`generate`
rewrites the generated imports (and the module name the classes are registered under) to
``protos.baton.v1``. It writes ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` next to
each ``.proto``; the freshness test (``tests/test_protos_fresh.py``) calls
:func:`generate` into a temporary root and compares byte for byte.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = Path("protos")  # the -I root, relative to the repository root
PACKAGE_DIR = Path("baton") / "v1"  # relative to PROTO_ROOT
PROTO_DIR = PROTO_ROOT / PACKAGE_DIR  # relative to the repository root
PYTHON_PACKAGE = "protos.baton.v1"  # how the generated modules are imported here
REGENERATE_COMMAND = "python -m protos.generate"

# (pattern, replacement) applied to every generated file: protoc's view of the package
# (``baton.v1``) -> where the modules are imported from (``protos.baton.v1``).
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    # `from baton.v1 import common_pb2 as ...` in *_pb2.py, *_pb2.pyi and *_pb2_grpc.py.
    (re.compile(r"^from baton\.v1 import ", re.MULTILINE), f"from {PYTHON_PACKAGE} import "),
    # The module name the message classes report (__module__, pickling, repr).
    (
        re.compile(r"BuildTopDescriptorsAndMessages\(DESCRIPTOR, 'baton\.v1\."),
        f"BuildTopDescriptorsAndMessages(DESCRIPTOR, '{PYTHON_PACKAGE}.",
    ),
    # The path named in *_pb2_grpc.py's version-mismatch message.
    (re.compile(r"generated code in baton/v1/"), f"generated code in {PROTO_DIR.as_posix()}/"),
)


def proto_files() -> list[Path]:
    """The ``.proto`` files, relative to the repository root, in a stable order."""
    return sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / PROTO_DIR).glob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """The generated modules under ``root`` (relative to it), in a stable order."""
    out: list[Path] = []
    for pattern in ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py"):
        out.extend(p.relative_to(root) for p in (root / PROTO_DIR).glob(pattern))
    return sorted(out)


def rewrite_imports(source: str) -> str:
    """``source`` with protoc's ``baton.v1`` module references pointed at ``protos.baton.v1``."""
    for pattern, replacement in _REWRITES:
        source = pattern.sub(replacement, source)
    return source


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Compile every proto into ``out_root`` (which mirrors the repository root).

    Runs ``python -m grpc_tools.protoc -I.`` in ``protos/``, in a subprocess so the
    caller's working directory is untouched, then rewrites the generated imports (module
    doc). Returns the generated paths relative to ``out_root``. Raises RuntimeError when
    protoc fails, or when a generated import escaped the rewrite.
    """
    protos = proto_files()
    if not protos:
        raise RuntimeError(f"no .proto files under {REPO_ROOT / PROTO_DIR}")
    out_root = out_root.resolve()
    out_dir = out_root / PROTO_ROOT
    (out_root / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I.",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(p.relative_to(PROTO_ROOT).as_posix() for p in protos),
    ]
    done = subprocess.run(
        cmd, cwd=REPO_ROOT / PROTO_ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"protoc failed with exit code {done.returncode}: {' '.join(cmd)}\n{done.stderr}"
        )
    generated = generated_files(out_root)
    for rel in generated:
        path = out_root / rel
        source = rewrite_imports(path.read_text(encoding="utf-8"))
        if re.search(r"^(from|import) baton\b", source, re.MULTILINE):
            raise RuntimeError(f"{rel}: an import of 'baton' escaped the rewrite to protos.")
        path.write_text(source, encoding="utf-8")
    return generated


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
