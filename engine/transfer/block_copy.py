"""How KV blocks are grouped, gathered, scattered and checksummed for transport.

Blocks move a layer group at a time: ``kv[l0:l1]`` indexed on ``BLOCK_DIM`` by the
job's block ids, which yields one contiguous ``[l1-l0, 2, heads, n, block_size,
head_dim]`` tensor. The checksum covers those gathered tensors in layer order, so it is
the same however a side splits the layers into groups.
"""

from __future__ import annotations

import math
import zlib

import torch

from engine.kv_layout import BLOCK_DIM, DTYPE_SIZES, KVLayout

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_MASK32 = 0xFFFFFFFF
_WEIGHT_MOD = 65521  # largest prime below 2**16, as in Adler-32


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
    """One job's block ids, as a device tensor and as runs of consecutive ids.

    On the CPU a copy per run beats ``index_copy_`` about threefold (and pools often hand
    out consecutive blocks); on a GPU one indexed kernel beats many small copies.
    """

    def __init__(self, block_ids: tuple[int, ...], device: torch.device) -> None:
        self.ids = block_ids
        self.device = device
        self.tensor = torch.tensor(block_ids, dtype=torch.int64, device=device)
        self.runs: list[tuple[int, int, int]] = []  # (first block id, first position, length)
        for pos, block in enumerate(block_ids):
            if self.runs and self.runs[-1][0] + self.runs[-1][2] == block:
                first, start, length = self.runs[-1]
                self.runs[-1] = (first, start, length + 1)
            else:
                self.runs.append((block, pos, 1))

    def __len__(self) -> int:
        return len(self.ids)


def gather(kv: torch.Tensor, lo: int, hi: int, index: BlockIndex, out: torch.Tensor) -> None:
    """``out`` = layers ``lo:hi`` of blocks ``index`` of ``kv``, in index order."""
    pool, staged = _as_3d(kv[lo:hi]), _as_3d(out)
    if index.device.type != "cpu":
        torch.index_select(pool, 1, index.tensor, out=staged)
        return
    for block, pos, length in index.runs:
        staged[:, pos:pos + length].copy_(pool[:, block:block + length])


def scatter(kv: torch.Tensor, lo: int, hi: int, index: BlockIndex, src: torch.Tensor) -> None:
    """The inverse of ``gather``: block i of ``src`` lands in block ``index[i]`` of ``kv``."""
    pool, staged = _as_3d(kv[lo:hi]), _as_3d(src)
    if index.device.type != "cpu":
        pool.index_copy_(1, index.tensor, staged)
        return
    for block, pos, length in index.runs:
        pool[:, block:block + length].copy_(staged[:, pos:pos + length])


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
    """An order-sensitive checksum over a stream of contiguous tensors.

    CPU tensors: zlib.crc32 over their bytes. CUDA tensors: a position-weighted sum of
    16-bit words kept on the device, so that no group forces a host round trip; both
    sides of one transport use the same device type, hence the same function.
    """

    def __init__(self) -> None:
        self._crc = 0
        self._words = 0
        self._s1: torch.Tensor | None = None
        self._s2: torch.Tensor | None = None

    def update(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous(), "checksum needs the bytes in wire order"
        if tensor.device.type == "cpu":
            self._crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), self._crc)
            return
        words = tensor.reshape(-1).view(torch.int16).to(torch.int64)
        pos = torch.arange(self._words, self._words + words.numel(), device=words.device)
        weighted = (words * (pos % _WEIGHT_MOD + 1)).sum()
        self._s1 = words.sum() if self._s1 is None else self._s1 + words.sum()
        self._s2 = weighted if self._s2 is None else self._s2 + weighted
        self._words += words.numel()

    @property
    def value(self) -> int:
        if self._s1 is None or self._s2 is None:
            return self._crc
        return ((int(self._s1.item()) & _MASK32) << 32) | (int(self._s2.item()) & _MASK32)


def checksum_blocks(
    kv: torch.Tensor, layout: KVLayout, block_ids: tuple[int, ...], group_bytes: int,
    staging: Staging,
) -> int:
    """The checksum a sender reports for moving exactly ``block_ids`` of ``kv``."""
    index = BlockIndex(block_ids, kv.device)
    per_group = layers_per_group(layout, len(block_ids), group_bytes)
    checksum = KVChecksum()
    for lo, hi in layer_groups(layout.num_layers, per_group):
        out = staging.typed(0, group_shape(layout, lo, hi, len(block_ids)), kv.dtype)
        gather(kv, lo, hi, index, out)
        checksum.update(out)
    return checksum.value
