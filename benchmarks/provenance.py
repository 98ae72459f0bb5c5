"""Where a benchmark figure came from: command, date, git revision, machine, load average.

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


# The CPU features that decide which kernels are fast (oneDNN's bf16 GEMM on AMX is
# several times its AVX512-BF16 speed): every results file names them.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def isa_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """Which of ``ISA_FLAGS`` this CPU has, e.g. ``avx2 avx512f avx512_bf16`` (``none``)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "unknown"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return " ".join(f for f in ISA_FLAGS if f in flags) or "none"


def is_busy(load: float, cpus: int | None = None) -> bool:
    """Whether a 1-minute load average means other work shared the machine."""
    return load > BUSY_LOAD_PER_CPU * (cpus or os.cpu_count() or 1)


def header_lines(
    command: str,
    threads: int,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    when: dt.datetime | None = None,
) -> list[str]:
    """The provenance lines every results file starts with (markdown)."""
    when = when or dt.datetime.now()
    return [
        f"Command: `{command}`  ",
        f"Date: {when:%Y-%m-%d %H:%M}; git revision: {git_revision()}  ",
        f"Machine: {machine()}; {threads} torch threads  ",
        f"Load average (1/5/15 min): {'/'.join(f'{x:.2f}' for x in load_before)} before,"
        f" {'/'.join(f'{x:.2f}' for x in load_after)} after",
    ]
