"""Transparent huge pages for the KV pool and the weights on CPU.

A decode step reads every sequence's K and V through its block table, and a paged block
of one head is 2-4 KiB: with 4 KiB pages each block is a page of its own, at a random
place in the pool, so nearly every block read misses the TLB and walks the page tables
before the hardware prefetcher can start on it. Backing the pool with 2 MiB pages keeps
the walks rare. Decode attention over shuffled blocks (26 sequences, 9155 tokens of
context, SmolLM2-135M's 30 layers, 2 threads) ran 1.20x faster in bf16 and 1.24x in fp32
(``python -m benchmarks.kv_huge_pages``).

Linux only, and only where the kernel's THP mode is ``madvise`` or ``always``; anywhere
else the pool is an ordinary tensor. The pool is advised before its first touch, so its
pages are huge from the start and nothing has to be copied later. ``BATON_HUGE_PAGES=0``
turns it off (read at each allocation).

The weights gain the same way: a batch-1 decode step streams every weight once, a few
hundred KiB to a few MiB a matrix, and on 4 KiB pages each page costs a TLB walk before
the prefetcher can run ahead. ``HugePageArena`` holds them in one mapping of 2 MiB pages.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import sys
import weakref
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or
    ``unavailable`` off Linux or without THP."""
    if not sys.platform.startswith("linux"):
        return "unavailable"
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def huge_pages_enabled() -> bool:
    return os.environ.get("BATON_HUGE_PAGES", "1") != "0" and thp_mode() in ("always", "madvise")


def _advised_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with ``nbytes`` from a huge-page edge on (that edge's offset
    in it), advised before anything touches it: memory from the allocator may come from a
    heap whose pages are already faulted in small (glibc serves blocks up to 32 MiB that
    way)."""
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % HUGE_PAGE_BYTES
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError as exc:
        logger.warning("madvise(MADV_HUGEPAGE) failed, memory stays on small pages: %s", exc)
    return buffer, offset


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, backed by huge pages where the
    kernel allows.

    The tensor gets an anonymous mapping of its own (``_advised_mapping``).
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not huge_pages_enabled() or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    buffer, offset = _advised_mapping(nbytes)
    # The tensor keeps the mapping alive; the slack before ``offset`` is never touched.
    tensor = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=offset).view(shape)
    return tensor.zero_()  # the first touch: faults in huge pages where advised


# Where each tensor starts in an arena: a cache line, as the kernels' vector loads like.
_ARENA_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ARENA_ALIGN) * _ARENA_ALIGN


# The arenas of this process whose mappings are alive: (mapping, first byte, end).
_ARENAS: list[tuple[weakref.ref[mmap.mmap], int, int]] = []


def on_an_arena(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in a ``HugePageArena`` (whose mapping is still alive: any
    tensor in it keeps it so, and nothing else can be at those addresses meanwhile)."""
    _ARENAS[:] = [a for a in _ARENAS if a[0]() is not None]
    at = tensor.data_ptr()
    return any(begin <= at < end for _, begin, end in _ARENAS)


class HugePageArena:
    """One huge-page mapping that contiguous CPU tensors are copied into, one after
    another (``place``). Each placed tensor keeps the whole mapping alive, so place only
    tensors that live as long as each other (a model's weights).

    Build it with ``HugePageArena.for_tensors`` and place the tensors one at a time,
    dropping each original as you go: the peak is then the tensors plus the largest
    one, not twice the tensors."""

    def __init__(self, nbytes: int) -> None:
        self._buffer, self._offset = _advised_mapping(nbytes)
        self._end = self._offset + nbytes
        self._next = self._offset
        base = torch.frombuffer(self._buffer, dtype=torch.uint8, count=1).data_ptr()
        _ARENAS.append((weakref.ref(self._buffer), base + self._offset, base + self._end))

    @staticmethod
    def for_tensors(tensors: list[torch.Tensor]) -> HugePageArena | None:
        """An arena that holds ``tensors``, or None where huge pages are off or the
        tensors fill less than one huge page (then they are best left where they are)."""
        nbytes = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
        if not huge_pages_enabled() or nbytes < HUGE_PAGE_BYTES:
            return None
        return HugePageArena(nbytes)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of the CPU tensor ``tensor`` in the arena."""
        if tensor.device.type != "cpu":
            raise ValueError(f"HugePageArena holds CPU tensors, got one on {tensor.device}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return tensor.clone()
        if self._next + nbytes > self._end:
            raise ValueError(
                f"HugePageArena is full: {nbytes} bytes do not fit in the "
                f"{self._end - self._next} left"
            )
        placed = torch.frombuffer(
            self._buffer, dtype=tensor.dtype, count=tensor.numel(), offset=self._next
        ).view(tensor.shape)
        placed.copy_(tensor)  # the first touch: faults in huge pages where advised
        self._next += _aligned(nbytes)
        return placed


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of huge pages (AnonHugePages) under the mappings that overlap ``tensor``'s
    memory, from /proc/self/smaps; 0 off Linux."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split()[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and begin < hi
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
