"""The ``cuda_ipc`` transport: decode exports its GPU KV pool; prefill on the same host
writes into it on a dedicated stream. The GPU twin of ``shm``.

The pool is one CUDA allocation on the decode worker's device, exported with a CUDA
IPC handle carried (encoded) in the endpoint. The lease tables stay in a small CPU
shared-memory segment, with the shm protocol unchanged: a sender keeps its claim until
its copies have completed on the device (``event.synchronize()`` on the worker), so a
revoked lease is never written. CUDA cannot open an IPC handle in the process that
exported it: sender and receiver must be different processes.

Copies run on the sender's transfer streams, after the fence recorded when the job was
submitted (``cuda_stream``), never behind the prefill engine's later kernels; the
receiver's verify checksum runs on its own transfer stream, never behind decode
kernels.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from engine.errors import UnavailableError
from engine.kv_layout import KVLayout
from engine.transfer.base import KVEndpoint, Notify, SendJob, TransferConfig
from engine.transfer.block_copy import (
    BlockIndex,
    KVChecksum,
    Staging,
    gather,
    group_shape,
    scatter,
    torch_dtype,
)
from engine.transfer.cuda_stream import FenceBook, TransferStream
from engine.transfer.lease_receiver import Lease
from engine.transfer.queued_sender import StopCheck
from engine.transfer.shm import ShmLink, ShmReceiver, ShmSegment, ShmSender

_FIXED = struct.Struct("<qqqq?")  # device, size bytes, offset bytes, ref-counter offset, sync


@dataclass(frozen=True, slots=True)
class CudaIpcHandle:
    """What ``UntypedStorage._share_cuda_`` returns, in a fixed binary encoding."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def to_bytes(self) -> bytes:
        fixed = _FIXED.pack(self.device, self.size_bytes, self.offset_bytes,
                            self.ref_counter_offset, self.event_sync_required)
        parts = [self.handle, self.ref_counter_handle, self.event_handle]
        return fixed + b"".join(struct.pack("<I", len(p)) + p for p in parts)

    @classmethod
    def from_bytes(cls, raw: bytes) -> CudaIpcHandle:
        if len(raw) < _FIXED.size:
            raise ValueError(f"cuda_ipc handle of {len(raw)} bytes is too short")
        device, size, offset, rc_offset, sync = _FIXED.unpack_from(raw)
        pos, parts = _FIXED.size, []
        for _ in range(3):
            (length,) = struct.unpack_from("<I", raw, pos)
            parts.append(raw[pos + 4:pos + 4 + length])
            pos += 4 + length
        return cls(device, parts[0], size, offset, parts[1], rc_offset, parts[2], sync)


def export_pool(pool: torch.Tensor) -> CudaIpcHandle:
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, sync = (
        pool.untyped_storage()._share_cuda_()
    )
    return CudaIpcHandle(int(device), bytes(handle), int(size), int(offset), bytes(rc_handle),
                         int(rc_offset), bytes(ev_handle), bool(sync))


def open_pool(handle: CudaIpcHandle, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    shape = layout.pool_shape(num_blocks)
    stride = torch.empty(shape, device="meta").stride()
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(shape), stride, 0, torch.UntypedStorage, torch_dtype(layout),
        handle.device, handle.handle, handle.size_bytes, handle.offset_bytes, False,
        handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
        handle.event_sync_required,
    )


class CudaIpcReceiver(ShmReceiver):
    """Decode's pool on a GPU, exported by CUDA IPC; lease tables in CPU shared memory."""

    kind = "cuda_ipc"
    pool_in_segment = False

    def _allocate_pool(self, device: torch.device) -> tuple[torch.Tensor, bytes]:
        if device.type != "cuda":
            raise ValueError(f"the cuda_ipc transport keeps its pool on a GPU, got {device}")
        pool = torch.zeros(self.layout.pool_shape(self.num_blocks),
                           dtype=torch_dtype(self.layout), device=device)
        torch.cuda.synchronize(device)  # the exported memory must be initialised
        self._transfer = TransferStream(device)
        return pool, export_pool(pool).to_bytes()

    def _check(self, lease: Lease):  # noqa: ANN202 - as LeaseReceiver._check
        with self._transfer.active():  # the verify gather must not wait for decode kernels
            return super()._check(lease)


class CudaIpcLink(ShmLink):
    """Copies on a dedicated stream of the source GPU (and of the pool's GPU if different)."""

    def __init__(self, segment: ShmSegment, pool: torch.Tensor, kv: torch.Tensor,
                 layout: KVLayout, config: TransferConfig, writer: int, name: str,
                 fences: FenceBook) -> None:
        super().__init__(segment, pool, kv, layout, config, writer, name)
        self._fences = fences
        self._fence: torch.cuda.Event | None = None
        self._src_stream = torch.cuda.Stream(kv.device)
        same = pool.device == kv.device
        self._dst_stream = self._src_stream if same else torch.cuda.Stream(pool.device)
        # Two staging buffers; a buffer is reused only after the copy out of it landed.
        self._buffers = (Staging(kv.device), Staging(kv.device))
        self._landed: list[torch.cuda.Event | None] = [None, None]
        self._last: torch.cuda.Event | None = None

    def send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        self._fence = self._fences.take(job.request_id)
        # Index uploads and checksum reads happen on the transfer streams too: each block
        # index is made on first use, inside the stream that uses it.
        with torch.cuda.device(self._kv.device), torch.cuda.stream(self._src_stream):
            return super().send(job, stop)

    def _copy_group(self, group: int, lo: int, hi: int, src: BlockIndex, dst: BlockIndex,
                    checksum: KVChecksum) -> int:
        slot = group % 2
        staging = self._buffers[slot].typed(0, group_shape(self._layout, lo, hi, len(src)),
                                            self._kv.dtype)
        if group == 0 and self._fence is not None:
            # The source blocks are final once the compute issued before the submit ran;
            # later prefill kernels are no reason to wait.
            self._src_stream.wait_event(self._fence)
            self._fence = None
        with torch.cuda.stream(self._src_stream):
            landed = self._landed[slot]
            if landed is not None:
                self._src_stream.wait_event(landed)
            gather(self._kv, lo, hi, src, staging)
            checksum.update(staging)
            gathered = torch.cuda.Event()
            gathered.record(self._src_stream)
        with torch.cuda.device(self._pool.device), torch.cuda.stream(self._dst_stream):
            self._dst_stream.wait_event(gathered)
            moved = staging if staging.device == self._pool.device else staging.to(
                self._pool.device, non_blocking=True)
            scatter(self._pool, lo, hi, dst, moved)
            done = torch.cuda.Event()
            done.record(self._dst_stream)
        self._landed[slot] = done
        self._last = done
        return staging.nbytes

    def _quiesce(self) -> None:
        if self._last is not None:
            self._last.synchronize()
            self._src_stream.synchronize()  # the checksum's reductions too
            self._last = None


class CudaIpcSender(ShmSender):
    """Writes into exported GPU pools of receivers on this host."""

    kind = "cuda_ipc"
    pool_in_segment = False

    def __init__(
        self,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        config: TransferConfig | None = None,
        notify: Notify | None = None,
    ) -> None:
        self._fences = FenceBook(TransferStream(kv_cache.device))
        super().__init__(kv_cache, layout, config, notify)

    def submit(self, job: SendJob) -> None:
        self._fences.record(job.request_id)
        try:
            super().submit(job)
        except BaseException:
            self._fences.take(job.request_id)
            raise

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self._fences.take(request_id)

    def _make_link(self, segment: ShmSegment, endpoint: KVEndpoint) -> ShmLink:
        if self.kv_cache.device.type != "cuda":
            raise UnavailableError(f"cuda_ipc sender needs a GPU KV cache, has "
                                   f"{self.kv_cache.device}")
        try:
            pool = open_pool(CudaIpcHandle.from_bytes(endpoint.handle), self.layout,
                             endpoint.num_blocks)
        except RuntimeError as exc:
            raise UnavailableError(f"cannot open the CUDA IPC pool of receiver "
                                   f"{endpoint.incarnation}: {exc}") from exc
        return CudaIpcLink(segment, pool, self.kv_cache, self.layout, self.config,
                           self._writer_lock.id, endpoint.address, self._fences)
