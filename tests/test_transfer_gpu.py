"""The GPU transports (cuda_ipc, nccl, nixl) between independently started processes, the
device checksum, and the transfer stream's ordering against compute. Marked ``gpu``;
skipped without CUDA. nccl needs two GPUs (NCCL refuses two ranks on one); with one,
its gloo twin (tests/test_transfer_failures.py, test_transfer_protocol.py) runs the
same pair logic."""

from __future__ import annotations

import pytest
import torch

from engine.transfer.block_copy import Staging, checksum_blocks
from engine.transfer.cuda_stream import TransferStream
from engine.transfer.factory import make_receiver
from engine.transfer.nixl_agent import INSTALL_HINT, nixl_available
from tests.transfer_peer import cross_process_transfer, random_pool, small_layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_ipc_transfer_between_processes(dtype: str) -> None:
    sent, received = cross_process_transfer("cuda_ipc", dtype, "cuda:0", "cuda:0")
    assert sent["ok"], sent["error"]
    assert received["ok"], received["error"]
    assert received["data_ok"]


def test_cuda_ipc_transfer_across_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    sent, received = cross_process_transfer("cuda_ipc", "bfloat16", "cuda:1", "cuda:0")
    assert sent["ok"], sent["error"]
    assert received["ok"] and received["data_ok"], received


def test_nccl_transfer_between_processes() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks on one GPU")
    sent, received = cross_process_transfer("nccl", "bfloat16", "cuda:0", "cuda:1")
    assert sent["ok"], sent["error"]
    assert received["ok"], received["error"]
    assert received["data_ok"]


@pytest.mark.skipif(not nixl_available(), reason=f"nixl_cu12 is not importable: {INSTALL_HINT}")
def test_nixl_transfer_between_processes_on_one_gpu() -> None:
    """Both pools in VRAM of one GPU: NIXL registers them as VRAM and UCX moves the lease
    GPU to GPU (CUDA IPC), the same code as the CPU pools the CPU tests move."""
    sent, received = cross_process_transfer("nixl", "bfloat16", "cuda:0", "cuda:0")
    assert sent["ok"], sent["error"]
    assert received["ok"], received["error"]
    assert received["data_ok"]


@pytest.mark.skipif(not nixl_available(), reason=f"nixl_cu12 is not importable: {INSTALL_HINT}")
def test_nixl_transfer_across_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    sent, received = cross_process_transfer("nixl", "bfloat16", "cuda:1", "cuda:0")
    assert sent["ok"], sent["error"]
    assert received["ok"] and received["data_ok"], received


def test_device_checksum_ignores_grouping_and_sees_one_flipped_word() -> None:
    layout = small_layout("bfloat16", num_layers=5)
    pool = random_pool(layout, 8, seed=2, device="cuda")
    sums = {
        checksum_blocks(pool, layout, (3, 1, 6), size, Staging("cuda"))
        for size in (1, 700, 1 << 30)
    }
    assert len(sums) == 1
    swapped = checksum_blocks(pool, layout, (1, 3, 6), 1 << 30, Staging("cuda"))
    assert swapped not in sums
    pool[2, 1, 1, 6, 0, 0] += 1
    assert checksum_blocks(pool, layout, (3, 1, 6), 1 << 30, Staging("cuda")) not in sums


def test_cuda_ipc_pool_lives_on_the_configured_device() -> None:
    last = torch.cuda.device_count() - 1
    for device in ("cuda", f"cuda:{last}"):
        receiver = make_receiver("cuda_ipc", small_layout("bfloat16"), 8, device=device)
        try:
            want = torch.cuda.current_device() if device == "cuda" else last
            assert receiver.kv_cache.device == torch.device("cuda", want)
        finally:
            receiver.close()


def test_transfer_stream_waits_for_its_fence_and_not_for_later_compute() -> None:
    dev = torch.device("cuda", 0)
    streams = TransferStream(dev)
    src = torch.randn(1 << 20, device=dev)
    dst = torch.empty_like(src)
    torch.cuda.synchronize(dev)
    fence = streams.fence()  # nothing issued yet
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on the compute stream
    with streams.active():
        streams.after(fence)
        dst.copy_(src)
        copied = torch.cuda.Event()
        copied.record()
    copied.synchronize()
    assert not torch.cuda.default_stream(dev).query(), "the copy waited for later compute"
    assert torch.equal(dst, src)
    late = streams.fence()  # now the spinning kernel is before the fence
    with streams.active():
        streams.after(late)
        dst.zero_()
        zeroed = torch.cuda.Event()
        zeroed.record()
    assert not zeroed.query(), "the copy ran before the compute its fence names"
    torch.cuda.synchronize(dev)
    assert not dst.any()
