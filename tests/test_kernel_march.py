"""The compiled CPU kernels build for a named ISA (``BATON_CPU_MARCH``), and the AVX2 +
FMA build is checked against the references on hosts that would otherwise build
AVX-512: CI and development hosts differ, and each ISA has kernels of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.provenance import isa_flags
from engine.kernels import cpu as kernels_cpu

REPO = Path(__file__).resolve().parent.parent


def test_the_build_flags_follow_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels_cpu.MARCH_ENV, raising=False)
    assert kernels_cpu.cxx_flags()[-1] == "-march=native"
    monkeypatch.setenv(kernels_cpu.MARCH_ENV, "x86-64-v3")
    flags = kernels_cpu.cxx_flags()
    assert flags[-1] == "-march=x86-64-v3" and flags[:-1] == kernels_cpu.CXX_FLAGS
    monkeypatch.setenv(kernels_cpu.MARCH_ENV, "native -o /tmp/x")
    with pytest.raises(ValueError, match="BATON_CPU_MARCH"):
        kernels_cpu.cxx_flags()


def test_the_build_key_differs_by_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels_cpu.MARCH_ENV, raising=False)
    native = kernels_cpu._build_key("c++ 1")
    monkeypatch.setenv(kernels_cpu.MARCH_ENV, "x86-64-v3")
    assert kernels_cpu._build_key("c++ 1") != native


@pytest.mark.skipif(
    not (isa_flags()["avx512f"] and isa_flags()["avx2"]),
    reason="the host builds its kernels for AVX2 (or not x86) natively: the suite runs them",
)
def test_the_avx2_kernels_match_the_references_on_an_avx512_host() -> None:
    env = {**os.environ, kernels_cpu.MARCH_ENV: "x86-64-v3", "PYTHONPATH": str(REPO)}
    probe = subprocess.run(
        [sys.executable, "-c", "from engine.kernels.cpu import cpu_kernels as k; "
         "print(k() is not None and not k().bf16_dot)"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert probe.stdout.strip() == "True", probe.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_attention_kernels.py", "tests/test_decode_team.py",
         "tests/test_argmax_kernel.py",
         "-k", "decode or window or panels or fused or team or argmax"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
