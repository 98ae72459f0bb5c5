"""Where a benchmark figure came from: command, date, git revision, machine and the CPU
flags that decide its kernels (AMX or not), load average.

Every results file under ``benchmarks/results/`` starts with these lines, so that a figure
quoted in the README can be traced to the run that produced it and the state of the
machine while it ran. Standard library only.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

from engine.kernels.cpu import MARCH_ENV

REPO = Path(__file__).resolve().parent.parent

# 1-minute load average above which a 2-core machine counts as busy: other work then
# holds a core for a noticeable share of the run and ratios between engines drift.
BUSY_LOAD_PER_CPU = 0.25


def git_revision(repo: Path = REPO) -> str:
    """``<short sha>`` of HEAD, with ``+dirty`` when tracked files differ from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=repo, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def machine() -> str:
    """CPU model, CPU count and memory, e.g. ``Intel(R) Xeon(R) ..., 2 CPUs, 24 GiB``."""
    cpu = platform.processor() or platform.machine()
    mem = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f", {int(line.split()[1]) / 2**20:.0f} GiB"
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs{mem}"


# The CPU flags that decide which bf16 kernels win (``/proc/cpuinfo`` names): oneDNN's bf16
# GEMM runs on AMX tiles where there are some, several times its AVX512-BF16 speed.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def isa_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """Whether this CPU has each of ``ISA_FLAGS`` (from ``/proc/cpuinfo`` text, read if None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags = set(value.split())
            break
    return {f: f in flags for f in ISA_FLAGS}


def host_kind(flags: dict[str, bool]) -> str:
    """The kind of host a figure was made on, for the README's per-kind tables."""
    if flags.get("amx_bf16") and flags.get("amx_tile"):
        return "AMX"
    if flags.get("avx512_bf16"):
        return "AVX512-BF16 (no AMX)"
    if flags.get("avx512f"):
        return "AVX-512 (no bf16)"
    return "AVX2" if flags.get("avx2") else "other"


# host_kind -> the tag of a results file's name (``w1_<date>_<slug>.json``).
HOST_SLUGS = {
    "AMX": "amx",
    "AVX512-BF16 (no AMX)": "avx512-bf16",
    "AVX-512 (no bf16)": "avx512",
    "AVX2": "avx2",
    "other": "other",
}


def host_slug(kind: str) -> str:
    """``host_kind``'s tag for file names."""
    return HOST_SLUGS[kind]


def isa_line(flags: dict[str, bool] | None = None) -> str:
    """``ISA: AMX; flags avx2 avx512f avx512_bf16 amx_bf16 amx_tile; ONEDNN_MAX_CPU_ISA: none``
    (a flag the CPU lacks reads ``no-<flag>``)."""
    flags = isa_flags() if flags is None else flags
    have = " ".join(f if ok else f"no-{f}" for f, ok in flags.items())
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or "none"
    march = os.environ.get(MARCH_ENV) or "native"
    return (
        f"ISA: {host_kind(flags)}; flags {have}; ONEDNN_MAX_CPU_ISA: {cap}; "
        f"kernels built for -march={march}"
    )


def is_busy(load: float, cpus: int | None = None) -> bool:
    """Whether a 1-minute load average means other work shared the machine."""
    return load > BUSY_LOAD_PER_CPU * (cpus or os.cpu_count() or 1)


def header_lines(
    command: str,
    threads: int | None,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    when: dt.datetime | None = None,
    revision: str | None = None,
) -> list[str]:
    """The provenance lines every results file starts with (markdown); ``threads`` None
    for a harness whose processes size their own teams; ``revision`` the tree's as the
    run began (default: now)."""
    when = when or dt.datetime.now()
    team = "" if threads is None else f"; {threads} torch threads"
    return [
        f"Command: `{command}`  ",
        f"Date: {when:%Y-%m-%d %H:%M}; git revision: {revision or git_revision()}  ",
        f"Machine: {machine()}{team}  ",
        f"{isa_line()}  ",
        f"Load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in load_before)} before,"
        f" {'/'.join(f'{x:.2f}' for x in load_after)} after",
    ]


RESULTS = Path(__file__).resolve().parent / "results"


def results_slug() -> str:
    """The tail of a results file's name: this host's kind, and the ISA the kernels were
    built for where ``BATON_CPU_MARCH`` names one (runs on hosts of other kinds, or with
    other builds, the same day keep their own files)."""
    slug = host_slug(host_kind(isa_flags()))
    march = os.environ.get(MARCH_ENV)
    return f"{slug}_march-{march}" if march else slug


def publish(report: str, name: str, suffix: str = "", out: Path | None = None) -> Path:
    """Print a small benchmark's markdown ``report`` and write it to ``out`` (default
    ``benchmarks/results/<name>_<today><suffix>_<host kind>.md``: runs on hosts of other
    kinds the same day keep their own files); returns the path."""
    print(report)
    path = out or RESULTS / f"{name}_{dt.date.today()}{suffix}_{results_slug()}.md"
    path.write_text(report)
    print(f"wrote {path}")
    return path
