"""Device handling: one validated device per worker, transports that fit it, and models
built straight in their dtype."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.device import build_on, resolve_device
from engine.engine_core import EngineCore
from engine.transfer.base import check_transport_device
from engine.transfer.factory import make_receiver, make_sender
from rpc.worker_config import WorkerConfig
from tests.engine_helpers import make_core
from tests.transfer_peer import random_pool, small_layout


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int, current: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_cpu_resolves_to_cpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")


def test_bare_cuda_becomes_the_current_device_with_its_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda(monkeypatch, count=2, current=1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)


def test_cuda_index_past_the_visible_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, count=2, current=0)
    with pytest.raises(ValueError, match=r"device 'cuda:2'.*sees 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda_is_refused_naming_the_device() -> None:
    with pytest.raises(ValueError, match=r"device 'cuda:0': CUDA is not available"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "", "mps:0"])
def test_malformed_or_foreign_devices_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="device"):
        resolve_device(spec)


@pytest.mark.parametrize(
    ("kind", "device"),
    [("shm", "cpu"), ("gloo", "cpu"), ("cuda_ipc", "cuda"), ("nccl", "cuda:1")],
)
def test_transports_accept_their_device(kind: str, device: str) -> None:
    check_transport_device(kind, device)


@pytest.mark.parametrize(
    ("kind", "device", "fits"),
    [
        ("shm", "cuda:0", "cuda_ipc or nccl"),
        ("gloo", "cuda", "cuda_ipc or nccl"),
        ("cuda_ipc", "cpu", "shm or gloo"),
        ("nccl", "cpu", "shm or gloo"),
    ],
)
def test_transports_refuse_the_other_device_and_say_what_fits(
    kind: str, device: str, fits: str
) -> None:
    with pytest.raises(ValueError, match=rf"transport '{kind}'.*'{device}'.*{fits}"):
        check_transport_device(kind, device)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_config_refuses_a_transport_that_does_not_fit_the_device(role: str) -> None:
    with pytest.raises(ValueError, match="transport 'shm'.*'cuda:0'"):
        WorkerConfig.from_args(role, ["--device", "cuda:0"], {})
    env = {f"BATON_{role.upper()}_TRANSPORT": "nccl"}
    with pytest.raises(ValueError, match="transport 'nccl'.*'cpu'"):
        WorkerConfig.from_args(role, [], env)
    ok = WorkerConfig.from_args(role, ["--device", "cuda:1", "--transport", "cuda_ipc"], {})
    assert ok.engine.device == "cuda:1" and ok.transport == "cuda_ipc"


def test_single_process_worker_moves_no_kv_so_any_transport_goes() -> None:
    cfg = WorkerConfig.from_args("both", ["--single-process", "--device", "cuda"], {})
    assert cfg.engine.device == "cuda" and cfg.transport == "shm"


def test_factory_refuses_mismatched_devices_before_allocating() -> None:
    layout = small_layout()
    with pytest.raises(ValueError, match="transport 'nccl'.*'cpu'"):
        make_sender("nccl", random_pool(layout, 4, 0), layout)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        make_receiver("gloo", layout, 4, device="meta")


def test_build_on_allocates_parameters_in_the_target_dtype() -> None:
    with build_on(torch.device("cpu"), torch.bfloat16):
        linear = nn.Linear(8, 4)
        norm = nn.Parameter(torch.ones(3))
        explicit = torch.zeros(2, dtype=torch.float32)
        ints = torch.arange(3)
    assert linear.weight.dtype == torch.bfloat16 and linear.bias.dtype == torch.bfloat16
    assert norm.dtype == torch.bfloat16
    assert explicit.dtype == torch.float32 and ints.dtype == torch.int64
    assert torch.zeros(1).dtype == torch.float32  # nothing leaks past the block


def test_build_on_without_random_init_draws_no_random_numbers() -> None:
    """The random fills are skipped (the RNG is untouched), and only those: the
    parameters still come in the target dtype, and deterministic fills still run."""
    state = torch.get_rng_state()
    with build_on(torch.device("cpu"), torch.bfloat16, random_init=False):
        linear = nn.Linear(64, 32)
        embedding = nn.Embedding(16, 8)
        ones = nn.Parameter(torch.ones(3))
    assert torch.equal(torch.get_rng_state(), state)
    assert linear.weight.dtype == embedding.weight.dtype == torch.bfloat16
    assert torch.equal(ones, torch.ones(3, dtype=torch.bfloat16))
    with build_on(torch.device("cpu"), torch.bfloat16):
        nn.Linear(64, 32)
    assert not torch.equal(torch.get_rng_state(), state)


def test_build_on_is_private_to_its_thread() -> None:
    seen: list[torch.dtype] = []
    inside = threading.Event()
    done = threading.Event()

    def other() -> None:
        inside.wait(5)
        seen.append(torch.empty(1).dtype)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with build_on(torch.device("cpu"), torch.float16):
        inside.set()
        done.wait(5)
    thread.join(5)
    assert seen == [torch.float32]


def test_runner_refuses_a_kv_pool_on_another_device(tiny_llama: Path) -> None:
    def on_meta(layout, num_blocks):  # noqa: ANN001, ANN202
        return torch.empty(layout.pool_shape(num_blocks), dtype=torch.float32, device="meta")

    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", num_blocks=8)
    with pytest.raises(ValueError, match="on meta; expected .* on cpu"):
        EngineCore(cfg, kv_pool_factory=on_meta, show_progress=False)


def test_runner_builds_the_model_in_its_dtype(tiny_llama: Path) -> None:
    core = make_core(tiny_llama, dtype="bfloat16", num_blocks=8)
    dtypes = {p.dtype for p in core.runner.model.parameters()}
    assert dtypes == {torch.bfloat16}
    assert core.runner.device == torch.device("cpu")
