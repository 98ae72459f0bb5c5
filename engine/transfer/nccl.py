"""The ``nccl`` transport: the gloo code path with NCCL pair groups and GPU staging.

Only the pair group changes: NCCL builds it on the pool's GPU (an indexed device: a
bare ``cuda`` would make ``set_device`` fail on the pair thread), staging lives on that
GPU, and a wait polls the work's completion until its deadline (an NCCL wait only
orders streams), aborting the group on expiry. NCCL ignores tags; the per-pair job
sequence and the in-band group headers keep transfers apart.

A failure must end the pair, never the process. Two settings of PyTorch's NCCL backend
would otherwise kill it: its watchdog tears the process down on a timed-out or failed
operation by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 3), and it times operations
out after the group's timeout. So the group's timeout is longer than any wait of ours
(``group_timeout_s``), our deadline aborts the pair first, and the error handling is
set to abort only the communicator (2) before the first group is built.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import AbortedError
from engine.kv_layout import KVLayout
from engine.transfer.base import Notify, TransferConfig
from engine.transfer.gloo import GlooReceiver, GlooSender
from engine.transfer.pair_group import (
    PairGroup,
    abort_group,
    group_timeout_s,
    link_error,
    rendezvous_store,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.0002
# Read by each ProcessGroupNCCL when it is built; 2 = abort the communicator, keep the
# process (1 and 3 tear the process down, 0 leaves hung operations in place).
ERROR_HANDLING_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ERROR_HANDLING_PAIR_ONLY = "2"


def contain_nccl_errors() -> None:
    """Make NCCL failures end the communicator, not the process. Called when a transport
    is built, before any NCCL group exists (the setting is read at group creation)."""
    if os.environ.get(ERROR_HANDLING_VAR) != ERROR_HANDLING_PAIR_ONLY:
        if ERROR_HANDLING_VAR in os.environ:
            logger.warning(
                "%s=%s would let a failed KV transfer kill the worker; using %s",
                ERROR_HANDLING_VAR,
                os.environ[ERROR_HANDLING_VAR],
                ERROR_HANDLING_PAIR_ONLY,
            )
        os.environ[ERROR_HANDLING_VAR] = ERROR_HANDLING_PAIR_ONLY


class NcclPairGroup(PairGroup):
    """A 2-rank ProcessGroupNCCL on one GPU per side."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(
                f"the nccl transport needs an indexed CUDA device (cuda:N), got {device}"
            )
        self.device = device
        contain_nccl_errors()

    def make(
        self, store: dist.Store, prefix: str, rank: int, hostname: str, config: TransferConfig
    ) -> dist.ProcessGroup:
        torch.cuda.set_device(self.device)  # NCCL binds the calling thread's device
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=group_timeout_s(config))
        return dist.ProcessGroupNCCL(rendezvous_store(store, prefix, config), rank, 2, options)

    def wait(self, work: dist.Work, pg: dist.ProcessGroup, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                abort_group(pg)  # the pair cannot be trusted with a half-done operation
                raise AbortedError(f"{what}: the peer went silent for {timeout_s:.1f} s")
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
        device: str = "cuda:0",
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
