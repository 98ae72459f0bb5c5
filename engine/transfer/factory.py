"""Picks the sender and receiver classes for a transport kind; the one place that names them."""

from __future__ import annotations

import torch

from engine.device import resolve_device
from engine.kv_layout import KVLayout
from engine.transfer.base import (
    TRANSPORT_DEVICE_TYPES,
    TRANSPORT_KINDS,
    KVReceiver,
    KVSender,
    Notify,
    TransferConfig,
    check_transport_device,
)
from engine.transfer.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from engine.transfer.gloo import GlooReceiver, GlooSender
from engine.transfer.nccl import NcclReceiver, NcclSender
from engine.transfer.nixl import NixlSender
from engine.transfer.nixl_receiver import NixlReceiver
from engine.transfer.shm import ShmReceiver, ShmSender

_SENDERS: dict[str, type[KVSender]] = {
    "shm": ShmSender,
    "gloo": GlooSender,
    "cuda_ipc": CudaIpcSender,
    "nccl": NcclSender,
    "nixl": NixlSender,
}
_RECEIVERS = {
    "shm": ShmReceiver,
    "gloo": GlooReceiver,
    "cuda_ipc": CudaIpcReceiver,
    "nccl": NcclReceiver,
    "nixl": NixlReceiver,
}
_DEFAULT_ADDRESSES = {
    "shm": "",
    "gloo": "127.0.0.1:0",
    "cuda_ipc": "",
    "nccl": "127.0.0.1:0",
    "nixl": "",
}


def _check_kind(kind: str) -> None:
    if kind not in TRANSPORT_KINDS:
        raise ValueError(f"transport kind must be one of {list(TRANSPORT_KINDS)}, got {kind!r}")


def make_sender(
    kind: str,
    kv_cache: torch.Tensor,
    layout: KVLayout,
    config: TransferConfig | None = None,
    notify: Notify | None = None,
) -> KVSender:
    """A sender reading source blocks from ``kv_cache`` (the prefill engine's pool)."""
    _check_kind(kind)
    check_transport_device(kind, str(kv_cache.device))
    return _SENDERS[kind](kv_cache, layout, config, notify)  # type: ignore[call-arg]


def make_receiver(
    kind: str,
    layout: KVLayout,
    num_blocks: int,
    address: str | None = None,
    config: TransferConfig | None = None,
    notify: Notify | None = None,
    device: str | None = None,
) -> KVReceiver:
    """A receiver that allocates a ``num_blocks`` pool. ``address``: shm / cuda_ipc, the
    segment name (random if empty); gloo / nccl, "host:port" to serve the store on (port 0
    picks one); nixl, a name for the pool (its agent's name if empty). ``device``: "cpu"
    for shm / gloo, a CUDA device for cuda_ipc / nccl (a bare "cuda" is the current
    device), either for nixl (default cpu); the pool is allocated there and nowhere else."""
    _check_kind(kind)
    resolved = resolve_device(TRANSPORT_DEVICE_TYPES[kind][0] if device is None else device)
    check_transport_device(kind, str(resolved))
    return _RECEIVERS[kind](
        layout,
        num_blocks,
        address=_DEFAULT_ADDRESSES[kind] if address is None else address,
        config=config,
        notify=notify,
        device=str(resolved),
    )
