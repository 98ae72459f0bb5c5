"""The transfer stream of a GPU transport, and the events that order it against compute.

KV copies, NCCL sends and receives, gathers, scatters and checksums of a transport run
on their own CUDA stream, never on the engine's compute stream: a receive scatter must
not queue behind decode kernels, nor a send behind the next prefill. NCCL orders its
internal stream after the *current* stream of the calling thread, so transport threads
make the transfer stream current (``TransferStream.active``).

What a copy must still wait for is named by a *fence*: an event recorded on the compute
stream when the work is handed over (a job submitted, a lease granted), so the copy
waits for the compute issued before that moment and for nothing issued later. Before a
transport reports data as landed, it waits on the host for its stream (``drain``).

On the CPU every method is a no-op, so the gloo twin runs the same calls as nccl.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

import torch

from engine.device import compute_stream

Fence = torch.cuda.Event


class TransferStream:
    """One transfer stream on ``device`` (none on the CPU). Thread-safe to share; the
    streams' work is ordered by the order of the calls that enqueue it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fence(self) -> Fence | None:
        """An event on the compute stream now: the compute issued so far."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(compute_stream(self.device))
        return event

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this device and its transfer stream current for the calling thread."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def after(self, fence: Fence | None) -> None:
        """Later work on the transfer stream waits for ``fence`` (on the device only)."""
        if self.stream is not None and fence is not None:
            self.stream.wait_event(fence)

    def drain(self) -> None:
        """Block until everything issued on the transfer stream so far has run."""
        if self.stream is not None:
            self.stream.synchronize()


class FenceBook:
    """Fences recorded at hand-over time, kept until the transport thread takes them."""

    def __init__(self, streams: TransferStream) -> None:
        self._streams = streams
        self._lock = threading.Lock()
        self._fences: dict[Hashable, Fence] = {}

    def record(self, key: Hashable) -> None:
        fence = self._streams.fence()
        if fence is not None:
            with self._lock:
                self._fences[key] = fence

    def take(self, key: Hashable) -> Fence | None:
        with self._lock:
            return self._fences.pop(key, None)
