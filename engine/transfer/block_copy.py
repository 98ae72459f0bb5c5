"""How KV blocks are grouped, gathered, scattered and checksummed for transport.

Blocks move a layer group at a time. The wire order of layers ``lo:hi`` is ``kv[lo:hi]``
indexed on ``BLOCK_DIM`` by the job's block ids: one contiguous ``[hi-lo, 2, heads, n,
block_size, head_dim]`` tensor. Seen as bytes it is a sequence of *rows*, one per
(layer, k/v, head), each holding the job's n blocks of ``block_size * head_dim`` elements
in job order. The checksum covers those bytes in that order, so it is the same however
a side splits the layers into groups, or the rows into pieces.

On the CPU (``HostPool``) a layer group streams through a small staging buffer a few
rows at a time: gathered into it by one indexed copy, hashed while it is still in cache
(xxh3-64), and written on from there. On a GPU one indexed kernel gathers a whole group
and a device-side sum checksums it (``KVChecksum``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import xxhash

from engine.kv_layout import BLOCK_DIM, DTYPE_SIZES, KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_MASK32 = 0xFFFFFFFF
_WEIGHT_MOD = 65521  # largest prime below 2**16, as in Adler-32
# Bytes of one CPU staging piece: small enough to stay in a core's L2 between the
# gather, the hash and the write that follow it (256 KiB-2 MiB measure alike).
PIECE_BYTES = 512 << 10


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return TORCH_DTYPES[layout.dtype]


def layers_per_group(layout: KVLayout, num_blocks: int, group_bytes: int) -> int:
    """How many layers of ``num_blocks`` blocks fit in about ``group_bytes`` (at least 1)."""
    per_layer = 2 * num_blocks * layout.block_numel_per_layer_kv * DTYPE_SIZES[layout.dtype]
    return max(1, min(layout.num_layers, group_bytes // per_layer))


def layer_groups(num_layers: int, per_group: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + per_group, num_layers)) for lo in range(0, num_layers, per_group)]


def group_shape(layout: KVLayout, lo: int, hi: int, num_blocks: int) -> tuple[int, ...]:
    shape = list(layout.pool_shape(num_blocks))
    shape[0] = hi - lo
    return tuple(shape)


def group_nbytes(layout: KVLayout, lo: int, hi: int, num_blocks: int) -> int:
    return (hi - lo) * 2 * num_blocks * layout.block_numel_per_layer_kv * DTYPE_SIZES[layout.dtype]


def _as_3d(tensor: torch.Tensor) -> torch.Tensor:
    """``[outer, blocks, inner]``: index_select on a 6-d view is ~100x slower on CPU."""
    return tensor.view(-1, tensor.shape[BLOCK_DIM], math.prod(tensor.shape[BLOCK_DIM + 1:]))


class BlockIndex:
    """One job's block ids: a numpy array for ``HostPool`` and, made on first use, a device
    tensor for one indexed kernel (``gather`` / ``scatter``)."""

    def __init__(self, block_ids: tuple[int, ...], device: torch.device) -> None:
        self.ids = block_ids
        self.device = device
        self.array = np.array(block_ids, dtype=np.intp)
        self.span = (min(block_ids), max(block_ids)) if block_ids else (0, -1)
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(self.ids, dtype=torch.int64, device=self.device)
        return self._tensor

    def __len__(self) -> int:
        return len(self.ids)


def gather(kv: torch.Tensor, lo: int, hi: int, index: BlockIndex, out: torch.Tensor) -> None:
    """``out`` = layers ``lo:hi`` of blocks ``index`` of ``kv``, in index order (GPU path)."""
    torch.index_select(_as_3d(kv[lo:hi]), 1, index.tensor, out=_as_3d(out))


def scatter(kv: torch.Tensor, lo: int, hi: int, index: BlockIndex, src: torch.Tensor) -> None:
    """The inverse of ``gather``: block i of ``src`` lands in block ``index[i]`` of ``kv``."""
    _as_3d(kv[lo:hi]).index_copy_(1, index.tensor, _as_3d(src))


class Staging:
    """A reusable byte buffer that grows to the largest request; one user at a time."""

    def __init__(self, device: torch.device | str = "cpu", pin: bool = False) -> None:
        self._device = torch.device(device)
        self._pin = pin and self._device.type == "cpu" and torch.cuda.is_available()
        self._buf = torch.empty(0, dtype=torch.uint8, device=self._device)

    def bytes(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 view of the first ``nbytes``; earlier views may be invalidated."""
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device,
                                    pin_memory=self._pin)
        return self._buf[:nbytes]

    def typed(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A typed view of this buffer starting at byte ``offset`` (grown if needed)."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self.bytes(offset + nbytes)[offset:].view(dtype).view(shape)


class KVChecksum:
    """An order-sensitive checksum over a stream of contiguous tensors or byte arrays.

    CPU data: xxh3-64 over the bytes, so the value depends only on the byte stream, not
    on how it was cut into updates. CUDA tensors: a position-weighted sum of 16-bit words
    kept on the device, so that no group forces a host round trip; both sides of one
    transport use the same device type, hence the same function.
    """

    def __init__(self) -> None:
        self._xxh = xxhash.xxh3_64()
        self._words = 0
        self._s1: torch.Tensor | None = None
        self._s2: torch.Tensor | None = None

    def update(self, data: torch.Tensor | np.ndarray) -> None:
        if isinstance(data, np.ndarray):
            assert data.flags.c_contiguous, "checksum needs the bytes in wire order"
            self._xxh.update(data.data)
            return
        assert data.is_contiguous(), "checksum needs the bytes in wire order"
        if data.device.type == "cpu":
            self._xxh.update(data.reshape(-1).view(torch.uint8).numpy().data)
            return
        words = data.reshape(-1).view(torch.int16).to(torch.int64)
        pos = torch.arange(self._words, self._words + words.numel(), device=words.device)
        weighted = (words * (pos % _WEIGHT_MOD + 1)).sum()
        self._s1 = words.sum() if self._s1 is None else self._s1 + words.sum()
        self._s2 = weighted if self._s2 is None else self._s2 + weighted
        self._words += words.numel()

    @property
    def value(self) -> int:
        if self._s1 is None or self._s2 is None:
            return self._xxh.intdigest()
        return ((int(self._s1.item()) & _MASK32) << 32) | (int(self._s2.item()) & _MASK32)


class HostPool:
    """A CPU KV pool seen as bytes ``[rows, num_blocks, row_bytes]`` (row: layer, k/v, head).

    Copies are numpy indexed copies, one call per piece of rows: single-threaded and free
    of the GIL. Torch copies would run on the intra-op pool, which the engine keeps busy:
    measured on two shared cores, a 16-block gather took 0.3 ms there when idle and tens
    of milliseconds when the cores were loaded, against about 0.5 ms here either way.
    """

    def __init__(self, kv: torch.Tensor) -> None:
        assert kv.device.type == "cpu" and kv.is_contiguous() and kv.dim() == 6
        self.rows_per_layer = kv.shape[1] * kv.shape[2]
        self.num_blocks = kv.shape[BLOCK_DIM]
        self.row_bytes = math.prod(kv.shape[BLOCK_DIM + 1:]) * kv.element_size()
        self.array = kv.reshape(-1).view(torch.uint8).numpy().reshape(
            -1, self.num_blocks, self.row_bytes)

    def rows(self, lo: int, hi: int) -> tuple[int, int]:
        """The rows of layers ``lo:hi``."""
        return lo * self.rows_per_layer, hi * self.rows_per_layer

    def gather(self, r0: int, r1: int, index: BlockIndex, out: np.ndarray) -> None:
        """``out[:, i]`` = block ``index[i]`` of rows ``r0:r1`` (``out``: ``[rows, n, bytes]``)."""
        self._check(index)
        # mode="clip" spares numpy a defensive copy of ``out``; the ids are in range.
        np.take(self.array[r0:r1], index.array, axis=1, out=out, mode="clip")

    def scatter(self, r0: int, r1: int, index: BlockIndex, src: np.ndarray) -> None:
        """The inverse of ``gather``."""
        self._check(index)
        self.array[r0:r1, index.array] = src

    def _check(self, index: BlockIndex) -> None:
        assert 0 <= index.span[0] and index.span[1] < self.num_blocks, (
            f"block ids {index.ids} outside [0, {self.num_blocks}): callers validate them")

    def stream(
        self, lo: int, hi: int, index: BlockIndex, checksum: KVChecksum,
        staging: Staging | None = None, dst: HostPool | None = None,
        dst_index: BlockIndex | None = None, out: np.ndarray | None = None,
    ) -> int:
        """Move layers ``lo:hi`` of blocks ``index`` in wire order, a few rows at a time:
        gather each piece (into ``out``, the group's wire bytes, if given; else into
        ``staging``), hash it, and write it to blocks ``dst_index`` of ``dst`` if given.
        Returns the bytes moved."""
        r0, r1 = self.rows(lo, hi)
        n = len(index)
        row_wire = n * self.row_bytes
        step = max(1, PIECE_BYTES // row_wire)
        if out is None:
            assert staging is not None
            out = staging.bytes(min(step, r1 - r0) * row_wire).numpy()
            reuse = True
        else:
            reuse = False
        for start in range(r0, r1, step):
            stop = min(start + step, r1)
            offset = 0 if reuse else (start - r0) * row_wire
            piece = out[offset:offset + (stop - start) * row_wire]
            rows = piece.reshape(stop - start, n, self.row_bytes)
            self.gather(start, stop, index, rows)
            checksum.update(piece)
            if dst is not None:
                assert dst_index is not None
                dst.scatter(start, stop, dst_index, rows)
        return (r1 - r0) * row_wire


def checksum_blocks(
    kv: torch.Tensor, layout: KVLayout, block_ids: tuple[int, ...], group_bytes: int,
    staging: Staging, pool: HostPool | None = None,
) -> int:
    """The checksum a sender reports for moving exactly ``block_ids`` of ``kv``.
    ``pool``: ``kv`` as a ``HostPool``, when the caller keeps one (CPU only)."""
    index = BlockIndex(block_ids, kv.device)
    checksum = KVChecksum()
    if kv.device.type == "cpu":
        pool = pool or HostPool(kv)
        pool.stream(0, layout.num_layers, index, checksum, staging)
        return checksum.value
    per_group = layers_per_group(layout, len(block_ids), group_bytes)
    for lo, hi in layer_groups(layout.num_layers, per_group):
        out = staging.typed(0, group_shape(layout, lo, hi, len(block_ids)), kv.dtype)
        gather(kv, lo, hi, index, out)
        checksum.update(out)
    return checksum.value
