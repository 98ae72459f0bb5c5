"""The measured route tables of this machine, on disk: one JSON file per key.

A table holds for one (CPU model and instruction-set flags, oneDNN's ISA cap, torch
version, compiled-kernel build, weight shapes, dtype, threads, rows timed) under
``$XDG_CACHE_HOME/baton/kernel_routes/`` (default ``~/.cache``), so a later start on the
same host reuses it in milliseconds and any change of those re-measures. The file name
hashes the key and the file repeats it, so a collision or a file from another version
reads as a miss; a file that does not parse (a crash mid-write on a filesystem without
atomic rename, a hand edit) is a miss too. Writes go to a temporary file renamed into
place, so a reader never sees half a table. Torch-free.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.kernels.route_table import ROW_CLASSES, RouteTable

logger = logging.getLogger(__name__)

# The source of a cached table measured on a busy host: reused while the host is busy,
# measured again once it is quiet.
BUSY_SOURCE = "cached, measured busy"
# Bump when the meaning of a route or of a key field changes, or how a table is
# measured (2: candidates timed in interleaved rounds), so that no host keeps a table
# the old way chose.
SCHEMA = 2
# The instruction-set flags that decide which kernel wins (``/proc/cpuinfo`` names).
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "amx_int8",
    "amx_fp16",
)


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/baton/kernel_routes``, ``~/.cache/baton/kernel_routes`` without it."""
    env = os.environ if env is None else env
    root = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "baton" / "kernel_routes"


def cpu_identity(cpuinfo: str | None = None) -> tuple[str, tuple[str, ...]]:
    """(CPU model name, the ISA_FLAGS it has) from ``/proc/cpuinfo`` text (read if None)."""
    if cpuinfo is None:
        cpuinfo = ""
        with contextlib.suppress(OSError):
            cpuinfo = Path("/proc/cpuinfo").read_text()
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name":
            model = value.strip()
        elif name in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, tuple(f for f in ISA_FLAGS if f in flags)


def cache_key(
    *,
    dtype: str,
    threads: int,
    shapes: list[tuple[int, int]],
    plan: Mapping[str, tuple[int, ...]],
    candidates: Mapping[str, tuple[str, ...]],
    torch_version: str,
    kernel_build: str,
    env: Mapping[str, str] | None = None,
    cpuinfo: str | None = None,
) -> dict[str, Any]:
    """Everything a measured table depends on, as a JSON-able dict."""
    env = os.environ if env is None else env
    model, flags = cpu_identity(cpuinfo)
    return {
        "schema": SCHEMA,
        "cpu": model,
        "isa": list(flags),
        "onednn_max_cpu_isa": env.get("ONEDNN_MAX_CPU_ISA", env.get("DNNL_MAX_CPU_ISA", "")),
        "torch": torch_version,
        "kernel_build": kernel_build,
        "dtype": dtype,
        "threads": threads,
        "shapes": [list(s) for s in shapes],
        "plan": {c: list(r) for c, r in sorted(plan.items())},
        "candidates": {c: list(r) for c, r in sorted(candidates.items())},
    }


def _path(cache_dir: Path, key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{digest}.json"


def load(cache_dir: Path, key: Mapping[str, Any]) -> RouteTable | None:
    """The cached table for ``key``, or None (no file, another key, unreadable)."""
    path = _path(cache_dir, key)
    try:
        data = json.loads(path.read_text())
        if data["key"] != json.loads(json.dumps(key)):
            return None
        routes = {c: str(data["routes"][c]) for c in ROW_CLASSES}
        timings = {c: {r: float(t) for r, t in v.items()} for c, v in data["timings"].items()}
        source = BUSY_SOURCE if data.get("measured_busy") else "cached"
        return RouteTable(routes=routes, source=source, timings=timings)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("ignoring unreadable kernel route cache %s (%s); measuring again", path, exc)
        return None


def store(
    cache_dir: Path, key: Mapping[str, Any], table: RouteTable, busy: bool = False
) -> Path | None:
    """Write ``table`` under ``key`` (temporary file + rename); None if it cannot be
    written (a read-only home: the routes still apply to this process). ``busy``: it was
    measured while other work shared the CPUs (``load`` then says ``BUSY_SOURCE``)."""
    path = _path(cache_dir, key)
    body = {
        "key": key,
        "measured_busy": busy,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "routes": table.routes,
        "timings": table.timings,
    }
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=cache_dir)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(body, fh, indent=1, sort_keys=True)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except OSError as exc:
        logger.warning("cannot cache kernel routes in %s: %s", cache_dir, exc)
        return None
    return path
