"""Sequentially consistent atomics on 64-bit words in shared memory, callable from Python.

The shm and cuda_ipc lease tables are words that processes race on: senders claim
blocks, a receiver revokes them. That is safe only with a compare-and-swap for the
claim, and with each side's store ordered before its load of the other side's word
(Dekker's handshake) on every CPU. Neither numpy nor the standard library has either (a
lock round trip orders a store before a load on x86, not on aarch64), so this module
provides three seq_cst operations on one aligned int64 word: ``cas``, ``load``,
``store``. Every access to a racing word goes through them, so their total order is
the whole protocol's.

They come from the first source that works here:

- on x86-64, three hand-assembled functions (``lock cmpxchg``; ``mov``; ``xchg``: the
  standard seq_cst mapping) copied into an executable page: nothing is compiled or
  installed, so a bare Python image has them;
- elsewhere (or where the kernel refuses an executable page), GCC's libatomic
  (``__atomic_*_8`` with ``__ATOMIC_SEQ_CST``; lock-free for 8 bytes on x86-64 and
  aarch64), if the system has it;
- otherwise ``atomic_ops`` raises ``RuntimeError`` naming the CPU and what is missing,
  and the transports that need it refuse to start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import platform
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_SEQ_CST = 5  # __ATOMIC_SEQ_CST
_WORD = 8

# x86-64 System V: rdi = word address, rsi / rdx = arguments, rax = result.
_X86_64_CAS = bytes.fromhex("4889f0f0480fb117c3")  # mov rax,rsi; lock cmpxchg [rdi],rdx
_X86_64_LOAD = bytes.fromhex("488b07c3")  # mov rax,[rdi]
_X86_64_STORE = bytes.fromhex("488737c3")  # xchg [rdi],rsi (implicitly locked)

# The functions neither block nor touch Python objects: calling them without releasing
# the GIL costs less than releasing it around a few nanoseconds of work.
_CAS_TYPE = ctypes.PYFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
_LOAD_TYPE = ctypes.PYFUNCTYPE(ctypes.c_int64, ctypes.c_void_p)
_STORE_TYPE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)


@dataclass(frozen=True, slots=True)
class AtomicOps:
    """The three seq_cst operations, on a word's address."""

    source: str  # where they come from, for logs and errors
    cas: Callable[[int, int, int], int]  # (address, expected, desired) -> the old value
    load: Callable[[int], int]  # (address) -> value
    store: Callable[[int, int], None]  # (address, value)
    code: object = None  # what holds their machine code, if this module wrote it


def _x86_64_builtin() -> AtomicOps:
    code = _X86_64_CAS + _X86_64_LOAD + _X86_64_STORE
    # Private to this process; unmapped only when the AtomicOps holding it goes.
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    cas = _CAS_TYPE(base)
    load = _LOAD_TYPE(base + len(_X86_64_CAS))
    store = _STORE_TYPE(base + len(_X86_64_CAS) + len(_X86_64_LOAD))
    _self_test(cas, load, store)
    return AtomicOps("x86-64 built-in", cas, load, store, page)


def _libatomic() -> AtomicOps:
    name = ctypes.util.find_library("atomic")
    if name is None:
        raise OSError("libatomic is not installed (Debian: libatomic1)")
    lib = ctypes.CDLL(name)
    exchange = lib.__atomic_compare_exchange_8
    exchange.restype = ctypes.c_bool
    exchange.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
    ]
    raw_load = lib.__atomic_load_8
    raw_load.restype = ctypes.c_int64
    raw_load.argtypes = [ctypes.c_void_p, ctypes.c_int]
    raw_store = lib.__atomic_store_8
    raw_store.restype = None
    raw_store.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]

    def cas(address: int, expected: int, desired: int) -> int:
        old = ctypes.c_int64(expected)  # a failed exchange writes the value it found here
        exchange(address, ctypes.byref(old), desired, _SEQ_CST, _SEQ_CST)
        return old.value

    def load(address: int) -> int:
        return int(raw_load(address, _SEQ_CST))

    def store(address: int, value: int) -> None:
        raw_store(address, value, _SEQ_CST)

    _self_test(cas, load, store)
    return AtomicOps(f"libatomic ({name})", cas, load, store)


def _self_test(
    cas: Callable[[int, int, int], int],
    load: Callable[[int], int],
    store: Callable[[int, int], None],
) -> None:
    """Refuse functions that do not behave as specified, rather than corrupt a pool."""
    word = np.zeros(1, dtype=np.int64)
    address = word.ctypes.data
    store(address, -7)
    ok = load(address) == -7 and cas(address, 1, 2) == -7 and int(word[0]) == -7
    ok = ok and cas(address, -7, 3) == -7 and int(word[0]) == 3
    if not ok:
        raise OSError("atomic operations failed their self-test")


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


class AtomicWords:
    """An int64 array in shared memory whose words are only read and written atomically.

    Holds the array, so the mapping under it stays while this object does. Indices are
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

    def _address(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(f"word {index} outside a table of {self.size}")
        return self._base + _WORD * index

    def load(self, index: int) -> int:
        return self._ops.load(self._address(index))

    def store(self, index: int, value: int) -> None:
        self._ops.store(self._address(index), value)

    def cas(self, index: int, expected: int, desired: int) -> int:
        """Set the word to ``desired`` if it holds ``expected``; return what it held."""
        return self._ops.cas(self._address(index), expected, desired)

    def all_equal(self, indices: tuple[int, ...], value: int) -> bool:
        """Whether every word at ``indices`` holds ``value``, each read atomically."""
        return all(self.load(i) == value for i in indices)
