"""Builds and loads the optional compiled CPU kernels (``cpu_ops.cpp``, ``csrc/``), once a machine.

The kernels are a plug-in: ``cpu_kernels()`` returns their ops, or None with one logged
warning when they cannot be built or loaded here, and every caller then runs its
plain-torch twin. The shared library is cached under ``~/.cache/baton/kernels/<key>``,
where the key hashes the source, the compiler flags, the compiler, torch and this CPU's
instruction-set flags, so a machine compiles it once (about 10-20 s) and every later
process only loads it. Concurrent first builds serialize on a file lock; a failed build
leaves a marker so later processes fall back at once instead of compiling again.

``BATON_CPU_KERNELS=0`` disables the kernels (read when first asked, not at import).
``BATON_CPU_MARCH`` names the instruction set to build for (``-march``; default
``native``): ``x86-64-v3`` builds the AVX2 + FMA kernels on an AVX-512 host, which is how
their tests and benchmarks run there, and how a fleet of mixed hosts shares one build.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")  # includes the kernels in csrc/*.h
LIBRARY_NAME = "baton_cpu_ops.so"
FAILED_MARKER = "build-failed.txt"
# -ffp-contract=off keeps a*b + c*d as torch computes it, so rms_norm and rotary are exact.
CXX_FLAGS = (
    "-O3",
    "-fopenmp",
    "-ffp-contract=off",
    "-std=c++20",
    "-fPIC",
    "-shared",
    "-w",
)
BUILD_TIMEOUT_S = 600
MARCH_ENV = "BATON_CPU_MARCH"
_MARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def cxx_flags() -> tuple[str, ...]:
    """The compiler flags of this process's build: ``CXX_FLAGS`` and the ``-march`` of
    ``BATON_CPU_MARCH`` (``native`` when unset). Raises ``ValueError`` naming the
    variable for a value that is not an architecture name."""
    march = os.environ.get(MARCH_ENV, "native")
    if not _MARCH.fullmatch(march):
        raise ValueError(f"{MARCH_ENV}={march!r} is not a -march value (e.g. native, x86-64-v3)")
    return (*CXX_FLAGS, f"-march={march}")


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """The loaded ops (``torch.ops.baton_cpu``) and what this build can do."""

    ops: Any
    # The build has the AVX512-BF16 dot product behind ``ops.linear_bf16``.
    bf16_dot: bool
    # The build's cache key (source, flags, compiler, torch, CPU flags): measured kernel
    # routes (engine.kernels.route_cache) hold for this build only.
    build_id: str = ""


def default_kernel_cache_dir() -> Path:
    return Path.home() / ".cache" / "baton" / "kernels"


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The compiled CPU kernels, built on first use; None (plain torch) when unavailable."""
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        logger.info("compiled CPU kernels disabled by BATON_CPU_KERNELS=0; using plain torch")
        return None
    try:
        path = _built_library(default_kernel_cache_dir())
        torch.ops.load_library(str(path))
        ops = torch.ops.baton_cpu
        return CpuKernels(ops=ops, bf16_dot=bool(ops.has_bf16_dot()), build_id=path.parent.name)
    except Exception as exc:  # noqa: BLE001 - any failure means: run the torch twin
        logger.warning("compiled CPU kernels unavailable, using plain torch: %s", exc)
        return None


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor()


def _build_key(compiler_version: str) -> str:
    h = hashlib.sha256()
    headers = sorted(SOURCE.with_name("csrc").glob("*.h"))
    for part in (
        SOURCE.read_bytes(),
        *(header.read_bytes() for header in headers),
        " ".join(cxx_flags()).encode(),
        compiler_version.encode(),
        torch.__version__.encode(),
        platform.machine().encode(),
        _cpu_flags().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _built_library(cache_root: Path) -> Path:
    """Path of the built library for this machine, compiling it if needed."""
    try:
        version = subprocess.run(
            [_compiler(), "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"no usable C++ compiler {_compiler()!r}: {exc}") from exc
    build_dir = cache_root / _build_key(version)
    library = build_dir / LIBRARY_NAME
    if library.exists():
        return library
    build_dir.mkdir(parents=True, exist_ok=True)
    with _locked(build_dir / ".lock"):
        if library.exists():  # another process built it while we waited
            return library
        failed = build_dir / FAILED_MARKER
        if failed.exists():
            raise RuntimeError(f"an earlier build failed, see {failed}")
        _compile(library, failed)
    return library


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    import fcntl

    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _compile(library: Path, failed: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dirs = library_paths()
    cmd = [
        _compiler(),
        *cxx_flags(),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
        str(SOURCE),
        *(f"-L{p}" for p in lib_dirs),
        *(f"-Wl,-rpath,{p}" for p in lib_dirs),
        "-lc10",
        "-ltorch_cpu",
    ]
    fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    logger.info("building compiled CPU kernels into %s (once per machine)", library.parent)
    try:
        proc = subprocess.run(
            [*cmd, "-o", str(tmp)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if proc.returncode != 0:
            failed.write_text(f"{' '.join(cmd)}\n\n{proc.stderr}")
            raise RuntimeError(f"compiling {SOURCE.name} failed (log: {failed})")
        os.replace(tmp, library)
    finally:
        tmp.unlink(missing_ok=True)
