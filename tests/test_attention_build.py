"""The GPU worker's start-up check of its Triton attention kernels: built once on a tiny
step before the KV pool and weights load; a kernel that does not build fails the start
with the cause and the fix, unless ``--attention-fallback torch`` chose the plain-torch
runner, which is logged as an error and shown by ``baton_attention_fallback``.

Without a GPU the build runs the real kernels under Triton's interpreter; the failures are
Triton's own first-launch errors, raised by a stand-in kernel.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.engine_core as engine_core
from engine.config import EngineConfig
from engine.layers import attention
from engine.layers.attention import (
    AttentionBuildError,
    build_triton_attention,
    choose_gpu_attention,
)
from rpc.worker_config import WorkerConfig

SHAPE = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "block_size": 16}
NO_COMPILER = "Failed to find C compiler. Please specify via CC environment variable."


def cpu_build(dtype: torch.dtype = torch.float32) -> functools.partial[None]:
    return functools.partial(build_triton_attention, torch.device("cpu"), dtype=dtype, **SHAPE)


def kernels_fail(monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[int]:
    """Make the Triton attention raise ``error`` at its first launch; counts launches."""
    launches: list[int] = []

    def launch(*args: Any) -> torch.Tensor:
        launches.append(1)
        raise error

    monkeypatch.setattr(attention, "triton_attention_backend", lambda: launch)
    return launches


def test_kernels_that_build_choose_triton() -> None:
    assert choose_gpu_attention("none", cpu_build()) == "triton"
    assert choose_gpu_attention("torch", cpu_build(torch.bfloat16)) == "triton"


def test_a_kernel_that_does_not_build_fails_with_the_cause_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launches = kernels_fail(monkeypatch, RuntimeError(NO_COMPILER))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/home/baton/.cache/triton")
    with pytest.raises(AttentionBuildError) as failed:
        choose_gpu_attention("none", cpu_build())
    message = str(failed.value)
    assert launches == [1]
    assert "did not build: RuntimeError: Failed to find C compiler" in message
    assert "/home/baton/.cache/triton" in message  # where the cache must be writable
    assert "--attention-fallback torch" in message
    assert isinstance(failed.value.__cause__, RuntimeError)


def test_an_unwritable_cache_or_no_triton_fails_too(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels_fail(monkeypatch, PermissionError(13, "Permission denied", "/home/baton/.triton"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    with pytest.raises(AttentionBuildError, match=r"Permission denied.*TRITON_CACHE_DIR unset"):
        choose_gpu_attention("none", cpu_build())
    monkeypatch.setattr(attention, "triton_attention_backend", lambda: None)
    with pytest.raises(AttentionBuildError, match="Triton does not import"):
        choose_gpu_attention("none", cpu_build())


def test_the_torch_fallback_is_chosen_only_by_the_flag_and_is_loud(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kernels_fail(monkeypatch, RuntimeError(NO_COMPILER))
    with caplog.at_level(logging.ERROR, logger="engine.layers.attention"):
        assert choose_gpu_attention("torch", cpu_build()) == "torch"
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert "Failed to find C compiler" in record.getMessage()
    assert "baton_attention_fallback is 1" in record.getMessage()
    with pytest.raises(ValueError, match="attention_fallback must be one of"):
        choose_gpu_attention("cpu", cpu_build())


class _Refused:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the Triton runner was built after its kernels failed")


class _PlainRunner:
    """Stands in for ModelRunner on a GPU: records that it was chosen."""

    built: list[str] = []

    def __init__(self, cfg: EngineConfig, *args: Any, **kwargs: Any) -> None:
        _PlainRunner.built.append(cfg.device)
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.lending = None  # no cores lent on a GPU (engine.core_lending)


@pytest.fixture
def on_a_gpu_whose_kernels_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineCore believes it runs on cuda:0 and the kernels fail to build there; the
    runners are stand-ins (no GPU here)."""
    monkeypatch.setattr(engine_core, "resolve_device", lambda spec: torch.device("cuda", 0))
    monkeypatch.setattr(engine_core, "CudaModelRunner", _Refused)
    monkeypatch.setattr(engine_core, "ModelRunner", _PlainRunner)
    _PlainRunner.built = []

    def build(device: torch.device, **shape: Any) -> None:
        assert device == torch.device("cuda", 0)
        assert shape["num_kv_heads"] >= 1 and shape["dtype"] == torch.float32
        raise RuntimeError(NO_COMPILER)

    monkeypatch.setattr(engine_core, "build_triton_attention", build)


@pytest.mark.usefixtures("on_a_gpu_whose_kernels_fail")
def test_the_engine_start_fails_before_loading_anything(tiny_llama: Path) -> None:
    pools: list[int] = []
    cfg = EngineConfig(model=str(tiny_llama), device="cuda", dtype="float32", num_blocks=8)
    with pytest.raises(AttentionBuildError, match="C compiler"):
        engine_core.EngineCore(cfg, kv_pool_factory=lambda layout, n: pools.append(n))
    assert pools == [] and _PlainRunner.built == []


@pytest.mark.usefixtures("on_a_gpu_whose_kernels_fail")
def test_the_engine_falls_back_to_the_plain_runner_only_when_asked(tiny_llama: Path) -> None:
    cfg = EngineConfig(
        model=str(tiny_llama),
        device="cuda",
        dtype="float32",
        num_blocks=8,
        attention_fallback="torch",
    )
    core = engine_core.EngineCore(cfg, show_progress=False)
    assert _PlainRunner.built == ["cuda"]
    assert core.stats().attention_fallback is True


def test_a_cpu_engine_never_builds_triton(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_core, "build_triton_attention", _Refused)
    core = engine_core.EngineCore(
        EngineConfig(model=str(tiny_llama), dtype="float32", num_blocks=8), show_progress=False
    )
    assert core.stats().attention_fallback is False
    core.runner.close()


def test_the_flag_and_its_env_twin_parse_and_bad_values_are_refused() -> None:
    cfg = WorkerConfig.from_args("decode", ["--attention-fallback", "torch"], {})
    assert cfg.engine.attention_fallback == "torch"
    env = {"BATON_PREFILL_ATTENTION_FALLBACK": "Torch"}
    assert WorkerConfig.from_args("prefill", [], env).engine.attention_fallback == "torch"
    assert WorkerConfig.from_args("decode", [], {}).engine.attention_fallback == "none"
    with pytest.raises(ValueError, match="attention_fallback must be 'none' or 'torch'"):
        WorkerConfig.from_args("decode", ["--attention-fallback", "cpu"], {})


_BUILD_ON_GPU = """
import functools, sys, torch
from engine.layers.attention import build_triton_attention, choose_gpu_attention
build = functools.partial(build_triton_attention, torch.device("cuda", 0), num_heads=4,
                          num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
print(choose_gpu_attention(sys.argv[1], build))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("compiler", ["found", "missing"])
def test_on_a_gpu_the_build_needs_a_c_compiler(compiler: str, tmp_path: Path) -> None:
    """Real Triton on a real GPU, in a fresh process with an empty cache (so nothing is
    reused): with the compiler the kernels build; with CC naming none, the start fails
    with the cause, and the flag's fallback is chosen only when asked."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    env.pop("TRITON_INTERPRET", None)
    if compiler == "missing":
        env["CC"] = str(tmp_path / "no-such-cc")

    def run(fallback: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _BUILD_ON_GPU, fallback],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip

    strict = run("none")
    if compiler == "found":
        assert strict.returncode == 0 and strict.stdout.split() == ["triton"], strict.stderr
        return
    assert strict.returncode != 0
    assert "AttentionBuildError" in strict.stderr and "did not build" in strict.stderr
    loud = run("torch")
    assert loud.returncode == 0 and loud.stdout.split() == ["torch"], loud.stderr
    assert "--attention-fallback torch" in loud.stderr
