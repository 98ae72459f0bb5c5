"""KV-cache transport between a prefill worker and a decode worker.

One interface (``base``: ``KVSender``, ``KVReceiver`` and the records crossing them),
several backends (``shm``, ``gloo``, ``nccl``, ``cuda_ipc``), built by
``factory.make_sender`` / ``factory.make_receiver``. This package and ``base`` stay
torch-free so that rpc/ can map the records to protos; import backends explicitly.
"""

from __future__ import annotations

from engine.transfer.base import (
    TRANSPORT_KINDS,
    KVDescriptor,
    KVEndpoint,
    KVReceiver,
    KVSender,
    RecvCompletion,
    SendCompletion,
    SendJob,
    TransferConfig,
)

__all__ = [
    "TRANSPORT_KINDS",
    "KVDescriptor",
    "KVEndpoint",
    "KVReceiver",
    "KVSender",
    "RecvCompletion",
    "SendCompletion",
    "SendJob",
    "TransferConfig",
]
