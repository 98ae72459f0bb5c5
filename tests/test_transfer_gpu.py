"""The GPU transports (cuda_ipc, nccl) between independently started processes, and the
device checksum. Marked ``gpu``; skipped without CUDA (nccl needs two GPUs)."""

from __future__ import annotations

import pytest
import torch

from engine.transfer.block_copy import Staging, checksum_blocks
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


def test_device_checksum_ignores_grouping_and_sees_one_flipped_word() -> None:
    layout = small_layout("bfloat16", num_layers=5)
    pool = random_pool(layout, 8, seed=2, device="cuda")
    sums = {checksum_blocks(pool, layout, (3, 1, 6), size, Staging("cuda"))
            for size in (1, 700, 1 << 30)}
    assert len(sums) == 1
    swapped = checksum_blocks(pool, layout, (1, 3, 6), 1 << 30, Staging("cuda"))
    assert swapped not in sums
    pool[2, 1, 1, 6, 0, 0] += 1
    assert checksum_blocks(pool, layout, (3, 1, 6), 1 << 30, Staging("cuda")) not in sums
