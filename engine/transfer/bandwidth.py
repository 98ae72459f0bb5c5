"""A micro-measurement of one transport against a plain memcpy, for the serving benchmark.

Sender and receiver live in this process on their own threads, so the numbers show the
transport's own cost (gather, checksum, wire, scatter) and not a peer's start-up.
``cuda_ipc`` cannot open its own export in one process and is not measured here.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from engine.kv_layout import KVLayout
from engine.transfer.base import SendJob, TransferConfig
from engine.transfer.block_copy import torch_dtype
from engine.transfer.factory import make_receiver, make_sender

T = TypeVar("T")

_GB = 1e9
_WAIT_S = 60.0


def measure(
    kind: str, layout: KVLayout, num_blocks: int, blocks_per_job: int, repeats: int,
    config: TransferConfig | None = None,
) -> dict[str, float | int | str]:
    """Move ``repeats`` jobs of ``blocks_per_job`` random blocks; return GB/s of the send
    (submit to sender completion), of send plus receiver verify, and of a torch memcpy of
    the same bytes on the same device (the faster of a multi- and a single-threaded one)."""
    if kind == "cuda_ipc":
        raise ValueError("cuda_ipc needs the sender and receiver in two processes; "
                         f"measure it with the serving benchmark, got kind {kind!r}")
    if not 1 <= blocks_per_job <= num_blocks or repeats < 1:
        raise ValueError(f"need 1 <= blocks_per_job ({blocks_per_job}) <= num_blocks "
                         f"({num_blocks}) and repeats ({repeats}) >= 1")
    device = "cuda" if kind == "nccl" else "cpu"
    wake = threading.Event()
    receiver = make_receiver(kind, layout, num_blocks, config=config, notify=wake.set)
    source = torch.randn(layout.pool_shape(num_blocks), device=device).to(torch_dtype(layout))
    sender = make_sender(kind, source, layout, config, notify=wake.set)
    rng = random.Random(0)
    job_bytes = blocks_per_job * layout.block_bytes
    try:
        send_s = verify_s = 0.0
        for i in range(repeats + 1):  # job 0 connects and warms up
            src = tuple(rng.sample(range(num_blocks), blocks_per_job))
            dst = tuple(rng.sample(range(num_blocks), blocks_per_job))
            deadline = time.monotonic() + _WAIT_S
            desc = receiver.expect(f"bw-{i}", dst, i, deadline)
            start = time.perf_counter()
            sender.submit(SendJob(f"bw-{i}", src, desc, deadline))
            sent = _next(sender.poll, wake)
            sent_at = time.perf_counter()
            if not sent.ok:
                raise RuntimeError(f"bandwidth job {i} failed: {sent.error}")
            receiver.verify(f"bw-{i}", sent.checksum or 0, i)
            done = _next(receiver.poll, wake)
            if not done.ok:
                raise RuntimeError(f"bandwidth job {i} did not verify: {done.error}")
            if i:
                send_s += sent_at - start
                verify_s += time.perf_counter() - start
    finally:
        sender.close()
        receiver.close()
    total = job_bytes * repeats
    return {
        "kind": kind,
        "bytes_per_job": job_bytes,
        "jobs": repeats,
        "transport_gbps": total / send_s / _GB,
        "verified_gbps": total / verify_s / _GB,
        "memcpy_gbps": _memcpy_gbps(job_bytes, repeats, device),
    }


def _next(poll: Callable[[], list[T]], wake: threading.Event) -> T:
    end = time.monotonic() + _WAIT_S
    while time.monotonic() < end:
        items = poll()
        if items:
            return items[0]
        wake.wait(0.01)
        wake.clear()
    raise TimeoutError(f"no completion within {_WAIT_S} s")


def _memcpy_gbps(nbytes: int, repeats: int, device: str) -> float:
    """The faster of two plain contiguous copies of ``nbytes``: torch's (on the process's
    intra-op threads) and, on the CPU, a single-threaded one (numpy), since the CPU
    transports copy on one thread; so no choice of threads can beat the ceiling."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copies: list[Callable[[], object]] = [lambda: dst.copy_(src)]
    if device == "cpu":
        src_np, dst_np = src.numpy(), dst.numpy()
        copies.append(lambda: np.copyto(dst_np, src_np))
    best = 0.0
    for copy in copies:
        copy()  # touch the pages once
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            copy()
        _sync(device)
        best = max(best, nbytes * repeats / (time.perf_counter() - start) / _GB)
    return best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
