"""Sequentially consistent atomics on 64-bit words in shared memory, callable from Python.

The shm and cuda_ipc lease tables are words that processes race on: senders claim
blocks, a receiver revokes them. That is safe only with a compare-and-swap for the
claim, and with each side's store ordered before its load of the other side's word
(Dekker's handshake) on every CPU. Neither numpy nor the standard library has either (a
lock round trip orders a store before a load on x86, not on aarch64), so this module
provides seq_cst ``cas``, ``load`` and ``store`` on one aligned int64 word, and bulk
forms over a list of words (one call per lease, not one per block: a ctypes call costs
about a microsecond, a job may hold hundreds of blocks and re-checks them every layer
group). Every access to a racing word goes through them, so their total order is the
whole protocol's.

They come from the first source that works here:

- on x86-64, hand-assembled functions (``lock cmpxchg``, ``mov``, ``xchg``: the standard
  seq_cst mapping) copied into an executable page: nothing is compiled or installed, so
  a bare Python image has them;
- elsewhere (or where the kernel refuses an executable page), GCC's libatomic
  (``__atomic_*_8`` with ``__ATOMIC_SEQ_CST``; lock-free for 8 bytes on x86-64 and
  aarch64), if the system has it, with the bulk forms as Python loops;
- otherwise ``atomic_ops`` raises ``RuntimeError`` naming the CPU and what is missing,
  and the transports that need it refuse to start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

_SEQ_CST = 5  # __ATOMIC_SEQ_CST
_WORD = 8

# x86-64 System V: rdi, rsi, rdx, rcx, r8 = arguments, rax = result. Loads are plain
# ``mov``s: seq_cst on x86 because every store to these words is locked.
_X86_64 = {
    # cas(word, expected, desired) -> old: mov rax,rsi; lock cmpxchg [rdi],rdx; ret
    "cas": "4889f0 f0480fb117 c3",
    # load(word) -> value: mov rax,[rdi]; ret
    "load": "488b07 c3",
    # store(word, value): xchg [rdi],rsi; ret
    "store": "488737 c3",
    # count_equal(base, index, n, value) -> how many base[index[i]] == value:
    #   xor eax,eax; xor r8d,r8d
    #   1: cmp r8,rdx; jae 3f; mov r9,[rsi+r8*8]; cmp [rdi+r9*8],rcx; jne 2f; inc rax
    #   2: inc r8; jmp 1b
    #   3: ret
    "count_equal": "31c0 4531c0 4939d0 7312 4e8b0cc6 4a390ccf 7503 48ffc0 49ffc0 ebe9 c3",
    # cas_prefix(base, index, n, expected, desired) -> k, the words swapped before the
    # first that did not hold ``expected``:
    #   xor r10d,r10d
    #   1: cmp r10,rdx; jae 2f; mov r11,[rsi+r10*8]; mov rax,rcx
    #      lock cmpxchg [rdi+r11*8],r8; jne 2f; inc r10; jmp 1b
    #   2: mov rax,r10; ret
    "cas_prefix": "4531d2 4939d2 7314 4e8b1cd6 4889c8 f04e0fb104df 7505 49ffc2 ebe7 4c89d0 c3",
    # store_all(base, index, n, value):
    #   xor r8d,r8d
    #   1: cmp r8,rdx; jae 2f; mov r9,[rsi+r8*8]; mov rax,rcx; xchg [rdi+r9*8],rax
    #      inc r8; jmp 1b
    #   2: ret
    "store_all": "4531c0 4939d0 7310 4e8b0cc6 4889c8 4a8704cf 49ffc0 ebeb c3",
}

# The functions neither block nor touch Python objects: calling them without releasing
# the GIL costs less than releasing it around a few nanoseconds of work.
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_TYPES = {
    "cas": ctypes.PYFUNCTYPE(_I64, _PTR, _I64, _I64),
    "load": ctypes.PYFUNCTYPE(_I64, _PTR),
    "store": ctypes.PYFUNCTYPE(None, _PTR, _I64),
    "count_equal": ctypes.PYFUNCTYPE(_I64, _PTR, _PTR, _I64, _I64),
    "cas_prefix": ctypes.PYFUNCTYPE(_I64, _PTR, _PTR, _I64, _I64, _I64),
    "store_all": ctypes.PYFUNCTYPE(None, _PTR, _PTR, _I64, _I64),
}


@dataclass(frozen=True, slots=True)
class AtomicOps:
    """The seq_cst operations, on raw addresses: ``base`` is word 0 of a table,
    ``index`` an int64 array of ``n`` word positions in it."""

    source: str  # where they come from, for logs and errors
    cas: Callable[[int, int, int], int]  # (word, expected, desired) -> the old value
    load: Callable[[int], int]  # (word) -> value
    store: Callable[[int, int], None]  # (word, value)
    count_equal: Callable[[int, int, int, int], int]  # (base, index, n, value) -> count
    # (base, index, n, expected, desired) -> words swapped before the first mismatch
    cas_prefix: Callable[[int, int, int, int, int], int]
    store_all: Callable[[int, int, int, int], None]  # (base, index, n, value)
    code: object = None  # what holds their machine code, if this module wrote it


def _x86_64_builtin() -> AtomicOps:
    codes = {name: bytes.fromhex(text) for name, text in _X86_64.items()}
    # Anonymous memory, unmapped only when the AtomicOps holding it goes. Written,
    # then made read-only and executable: never writable and executable at once.
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    functions: dict[str, Callable[..., int]] = {}
    for name, code in codes.items():
        functions[name] = _TYPES[name](base + page.tell())
        page.write(code)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [_PTR, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(base, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"cannot make a page executable: {os.strerror(errno)}")
    ops = AtomicOps("x86-64 built-in", code=page, **functions)  # type: ignore[arg-type]
    _self_test(ops)
    return ops


def _libatomic() -> AtomicOps:
    name = ctypes.util.find_library("atomic")
    if name is None:
        raise OSError("libatomic is not installed (Debian: libatomic1)")
    lib = ctypes.CDLL(name)
    exchange = lib.__atomic_compare_exchange_8
    exchange.restype = ctypes.c_bool
    exchange.argtypes = [_PTR, _PTR, _I64, ctypes.c_int, ctypes.c_int]
    raw_load = lib.__atomic_load_8
    raw_load.restype = _I64
    raw_load.argtypes = [_PTR, ctypes.c_int]
    raw_store = lib.__atomic_store_8
    raw_store.restype = None
    raw_store.argtypes = [_PTR, _I64, ctypes.c_int]

    def cas(word: int, expected: int, desired: int) -> int:
        old = ctypes.c_int64(expected)  # a failed exchange writes the value it found here
        exchange(word, ctypes.byref(old), desired, _SEQ_CST, _SEQ_CST)
        return old.value

    def load(word: int) -> int:
        return int(raw_load(word, _SEQ_CST))

    def store(word: int, value: int) -> None:
        raw_store(word, value, _SEQ_CST)

    def words(base: int, index: int, n: int) -> list[int]:
        return [base + _WORD * i for i in (ctypes.c_int64 * n).from_address(index)] if n else []

    def count_equal(base: int, index: int, n: int, value: int) -> int:
        return sum(load(word) == value for word in words(base, index, n))

    def cas_prefix(base: int, index: int, n: int, expected: int, desired: int) -> int:
        for k, word in enumerate(words(base, index, n)):
            if cas(word, expected, desired) != expected:
                return k
        return n

    def store_all(base: int, index: int, n: int, value: int) -> None:
        for word in words(base, index, n):
            store(word, value)

    ops = AtomicOps(
        f"libatomic ({name})", cas, load, store, count_equal, cas_prefix, store_all, lib
    )
    _self_test(ops)
    return ops


def _self_test(ops: AtomicOps) -> None:
    """Refuse functions that do not behave as specified, rather than corrupt a pool."""
    table = np.zeros(4, dtype=np.int64)
    base = table.ctypes.data
    index = np.array([2, 0, 3], dtype=np.int64)
    at = index.ctypes.data
    ops.store(base + 8, -7)
    ok = ops.load(base + 8) == -7 and ops.cas(base + 8, 1, 2) == -7 and table[1] == -7
    ok = ok and ops.cas(base + 8, -7, 3) == -7 and table[1] == 3
    table[3] = 5
    ok = ok and ops.cas_prefix(base, at, 3, 0, 9) == 2 and table.tolist() == [9, 3, 9, 5]
    ok = ok and ops.count_equal(base, at, 3, 9) == 2
    ops.store_all(base, at, 2, -1)
    ok = ok and table.tolist() == [-1, 3, -1, 5]
    if not ok:
        raise OSError(f"atomic operations failed their self-test: {table.tolist()}")


def _sources() -> list[tuple[str, Callable[[], AtomicOps]]]:
    sources: list[tuple[str, Callable[[], AtomicOps]]] = []
    if platform.machine().lower() in ("x86_64", "amd64"):
        sources.append(("x86-64 built-in", _x86_64_builtin))
    sources.append(("libatomic", _libatomic))
    return sources


@functools.cache
def atomic_ops() -> AtomicOps:
    """This process's atomics, found once. Raises ``RuntimeError`` where there are none."""
    failures = []
    for name, make in _sources():
        try:
            return make()
        except (OSError, AttributeError, ValueError) as exc:
            failures.append(f"{name}: {exc}")
    raise RuntimeError(
        f"no 64-bit shared-memory atomics on this {platform.machine() or 'unknown'} CPU "
        f"({'; '.join(failures)}); the shm and cuda_ipc transports need them: install "
        "libatomic, or use the gloo or nccl transport"
    )


@dataclass(frozen=True, slots=True)
class WordIndex:
    """Word positions for the bulk operations, checked once to lie in ``[0, bound)``."""

    array: np.ndarray  # contiguous int64
    bound: int

    @classmethod
    def of(cls, positions: Sequence[int], bound: int) -> WordIndex:
        array = np.ascontiguousarray(positions, dtype=np.int64)
        if array.ndim != 1 or (array.size and not (array.min() >= 0 and array.max() < bound)):
            raise IndexError(f"word positions {list(positions)} leave [0, {bound})")
        return cls(array, bound)

    def __len__(self) -> int:
        return int(self.array.shape[0])


class AtomicWords:
    """An int64 array in shared memory whose words are only read and written atomically.

    Holds the array, so the mapping under it stays while this object does. Positions are
    checked: an out-of-range word would be memory outside the table.
    """

    __slots__ = ("_array", "_base", "_ops", "size")

    def __init__(self, array: np.ndarray, ops: AtomicOps | None = None) -> None:
        if array.dtype != np.int64 or array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError(
                f"AtomicWords needs a contiguous 1-d int64 array, got {array.dtype}"
                f" of shape {array.shape}"
            )
        self._array = array
        self._base = array.ctypes.data
        if self._base % _WORD and array.size:
            raise ValueError(f"AtomicWords needs 8-byte aligned words, got address {self._base:#x}")
        self._ops = ops or atomic_ops()
        self.size = int(array.shape[0])

    def index(self, positions: Sequence[int]) -> WordIndex:
        return WordIndex.of(positions, self.size)

    def _word(self, position: int) -> int:
        if not 0 <= position < self.size:
            raise IndexError(f"word {position} outside a table of {self.size}")
        return self._base + _WORD * position

    def _words(self, index: WordIndex, start: int = 0, end: int | None = None) -> tuple[int, int]:
        """(address, count) of ``index[start:end]``, once it is known to fit this table."""
        if index.bound > self.size:
            raise IndexError(
                f"positions checked against {index.bound} used on a table of {self.size}"
            )
        end = len(index) if end is None else end
        if not 0 <= start <= end <= len(index):
            raise IndexError(f"slice [{start}:{end}] of {len(index)} positions")
        return index.array.ctypes.data + _WORD * start, end - start

    def load(self, position: int) -> int:
        return self._ops.load(self._word(position))

    def store(self, position: int, value: int) -> None:
        self._ops.store(self._word(position), value)

    def cas(self, position: int, expected: int, desired: int) -> int:
        """Set the word to ``desired`` if it holds ``expected``; return what it held."""
        return self._ops.cas(self._word(position), expected, desired)

    def all_equal(self, index: WordIndex, value: int) -> bool:
        """Whether every word at ``index`` holds ``value``."""
        at, n = self._words(index)
        return self._ops.count_equal(self._base, at, n, value) == n

    def cas_prefix(
        self, index: WordIndex, expected: int, desired: int, start: int = 0, end: int | None = None
    ) -> int:
        """Swap ``expected`` for ``desired`` in the words at ``index[start:end]``, in order,
        up to the first that does not hold ``expected``; return how many were swapped."""
        at, n = self._words(index, start, end)
        return self._ops.cas_prefix(self._base, at, n, expected, desired)

    def store_all(self, index: WordIndex, value: int) -> None:
        at, n = self._words(index)
        self._ops.store_all(self._base, at, n, value)
