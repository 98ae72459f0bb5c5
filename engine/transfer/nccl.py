"""The ``nccl`` transport: the gloo code path with NCCL pair groups and GPU staging.

Only the pair group changes: NCCL builds it, staging lives on the pool's GPU, and a
wait polls the work's completion until its deadline (an NCCL wait only orders streams),
aborting the group on expiry. NCCL ignores tags; the per-pair job sequence and the
in-band group headers keep transfers apart.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import DeadlineExceededError
from engine.kv_layout import KVLayout
from engine.transfer.base import Notify, TransferConfig
from engine.transfer.gloo import GlooReceiver, GlooSender
from engine.transfer.pair_group import PairGroup, link_error

_POLL_S = 0.0002


class NcclPairGroup(PairGroup):
    """A 2-rank ProcessGroupNCCL on one GPU per side."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the nccl transport needs a CUDA device, got {device}")
        self.device = device

    def make(self, store: dist.Store, prefix: str, rank: int, hostname: str,
             timeout_s: float) -> dist.ProcessGroup:
        torch.cuda.set_device(self.device)  # NCCL binds the calling thread's device
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, 2, options)

    def wait(self, work: dist.Work, pg: dist.ProcessGroup, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                pg.abort()  # the pair cannot be trusted with a half-done operation
                raise DeadlineExceededError(f"{what}: timed out after {timeout_s:.1f} s")
            time.sleep(_POLL_S)
        try:
            work.wait()
        except RuntimeError as exc:
            raise link_error(exc, what) from exc


class NcclReceiver(GlooReceiver):
    """Decode's pool on a GPU, fed over NCCL pair groups."""

    kind = "nccl"

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        address: str = "127.0.0.1:0",
        config: TransferConfig | None = None,
        notify: Notify | None = None,
        device: str = "cuda",
    ) -> None:
        self.pair_group = NcclPairGroup(torch.device(device))
        super().__init__(layout, num_blocks, address, config, notify, device)


class NcclSender(GlooSender):
    """Sends GPU KV over NCCL pair groups."""

    kind = "nccl"

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: TransferConfig | None = None,
        notify: Notify | None = None,
    ) -> None:
        self.pair_group = NcclPairGroup(kv_cache.device)
        super().__init__(kv_cache, layout, config, notify)
