"""A canonical byte encoding of hand-off records, so that a MAC covers every field.

``canonical(record)`` walks a dataclass record field by field, recursing into nested
records, and writes each value with a type byte and, where its length varies, a length
prefix. The encoding is injective (two values that differ in any field, at any depth,
encode differently) and depends only on the values, never on object identity or on the
wire format a record came from. Since it takes ``dataclasses.fields`` rather than a
hand-written list, a field added to a record later is covered without anyone
remembering to add it; a value of a type it does not know raises ``TypeError`` rather
than being skipped.

Numbers encode by value: ``2`` and ``2.0`` encode alike (a float that holds an integer
is written as that integer), because a proto ``double`` gives back ``0.0`` for a record
built with ``0``, and both sides of a hand-off must encode the same record the same way.
Lists and tuples encode alike for the same reason. Torch-free.
"""

from __future__ import annotations

import dataclasses
import enum
import struct

_LEN = struct.Struct("<Q")


def canonical(value: object) -> bytes:
    """The canonical bytes of ``value``: a dataclass record, or any value one may hold
    (None, bool, int, float, str, bytes, an enum member, a list or tuple of these)."""
    out = bytearray()
    _write(out, value)
    return bytes(out)


def _write(out: bytearray, value: object) -> None:
    if value is None:
        out += b"N"
    elif isinstance(value, bool):  # before int: True is an int too
        out += b"T" if value else b"F"
    elif isinstance(value, enum.Enum):
        out += b"E"
        _write_bytes(out, type(value).__qualname__.encode())
        _write(out, value.value)
    elif isinstance(value, int):
        _write_int(out, value)
    elif isinstance(value, float):
        if value.is_integer():  # finite and whole: the same bytes as the int
            _write_int(out, int(value))
        else:
            out += b"f"
            out += struct.pack("<d", value)
    elif isinstance(value, str):
        out += b"s"
        _write_bytes(out, value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, bytes | bytearray | memoryview):
        out += b"b"
        _write_bytes(out, bytes(value))
    elif isinstance(value, list | tuple):
        _write_sequence(out, value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        out += b"R"
        _write_bytes(out, type(value).__qualname__.encode())
        out += _LEN.pack(len(fields))
        for field in fields:
            _write_bytes(out, field.name.encode())
            _write(out, getattr(value, field.name))
    else:
        raise TypeError(f"canonical() cannot encode a {type(value).__name__}: {value!r}")


def _write_int(out: bytearray, value: int) -> None:
    out += b"i"
    _write_bytes(out, value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True))


def _write_bytes(out: bytearray, data: bytes) -> None:
    out += _LEN.pack(len(data))
    out += data


def _write_sequence(out: bytearray, items: list[object] | tuple[object, ...]) -> None:
    # A run of whole numbers (a prompt, block ids) is packed in one call, not written one
    # value at a time; which form a sequence takes depends only on its values.
    whole = items if all(type(item) is int for item in items) else [_whole(i) for i in items]
    if all(type(item) is int for item in whole):
        try:
            packed = struct.pack(f"<{len(whole)}q", *whole)
        except struct.error:  # an int beyond 64 bits: the general form below
            pass
        else:
            out += b"I"
            _write_bytes(out, packed)
            return
    out += b"L"
    out += _LEN.pack(len(items))
    for item in items:
        _write(out, item)


def _whole(item: object) -> object:
    """``item`` as the plain int ``_write`` encodes it as, or itself when it is written
    otherwise (a bool, an enum member, a fraction, a string ...)."""
    if isinstance(item, bool | enum.Enum):
        return item
    if isinstance(item, int) or (isinstance(item, float) and item.is_integer()):
        return int(item)
    return item
