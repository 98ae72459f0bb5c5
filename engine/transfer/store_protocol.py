"""The control messages of the process-group transports (gloo, nccl), and their store keys.

Control travels through the receiver's TCPStore, data through a 2-rank process group.
A sender takes a hello number (``KEY_HELLO_COUNT``), says hello (its incarnation and
layout) under it and rings ``KEY_HELLO_BELL``; the receiver takes hellos in any order,
gives up on a number left without a hello, and answers each with a verdict. Both then
build a pair group under a prefix naming both incarnations and the hello number, prove
it with one all-reduce, and the receiver then says whether its side of the group exists
(``ready_key``): a link is usable only after that second answer.
Each job is announced by a ``JobHeader`` under ``job/<seq>``; its layer groups follow
on the group, each message prefixed by ``GROUP_HEADER_BYTES`` (seq, group index, flags,
payload bytes) so that a message can never be taken for another job's.
The store is a plain TCP key-value store that anyone who reaches it can write. With a
fleet secret (``fleet_auth``) the receiver sets ``KEY_AUTH`` and accepts only a hello and
job headers tagged with it, and every value a peer reads is checked before use: the
sender's hello and job headers carry their tags (``sign_hello``, ``sign_job``), and the
receiver's incarnation, layout, verdicts and readiness, and both sides' process-group
rendezvous (rank addresses, NCCL's unique id) are sealed (``seal``/``unseal``) over the
key they are stored under and the receiver or pair they belong to, so they can be
neither forged nor replayed elsewhere.
Torch-free; fixed binary encodings, never pickles.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from engine.kv_layout import DTYPE_SIZES, KVLayout
from engine.transfer.fleet_auth import TAG_BYTES, FleetKey

KEY_INCARNATION = "baton/incarnation"
KEY_LAYOUT = "baton/layout"
KEY_HELLO_COUNT = "baton/hello_count"
# Set by a sender after its hello, so that a receiver idling on it wakes for every new
# hello whatever its number (the value means nothing; the receiver deletes it).
KEY_HELLO_BELL = "baton/hello_bell"
# Set (to AUTH_HMAC) by a receiver that admits only senders holding the fleet's secret:
# their hello and job headers then carry a tag (fleet_auth) after a separator.
KEY_AUTH = "baton/auth"
AUTH_HMAC = "hmac-sha256"
VERDICT_OK = "ok"
READY_OK = "ready"
VERDICT_NO_SECRET = "refused: the hello does not carry the fleet's secret"
GROUP_HEADER_WORDS = 4  # int64: seq, group, flags, payload bytes
GROUP_HEADER_BYTES = 8 * GROUP_HEADER_WORDS
FLAG_ABORT = 1  # the sender stopped this job; the payload is meaningless and no group follows

_JOB_FIXED = struct.Struct("<qqqqI")  # seq, epoch, lease token, layers per group, n blocks


def hello_key(n: int) -> str:
    return f"baton/hello/{n}"


def verdict_key(n: int) -> str:
    return f"baton/verdict/{n}"


def pair_prefix(receiver_incarnation: str, sender_incarnation: str, n: int) -> str:
    return f"baton/pair/{receiver_incarnation}/{sender_incarnation}/{n}"


def ready_key(prefix: str) -> str:
    return f"{prefix}/ready"


def job_key(prefix: str, seq: int) -> str:
    return f"{prefix}/job/{seq}"


def message_tag(seq: int) -> int:
    return seq & 0x7FFFFFFF


def encode_layout(layout: KVLayout) -> bytes:
    # A sixth field only in deterministic mode, so a default record reads as before.
    return (
        f"{layout.num_layers},{layout.block_size},{layout.num_kv_heads},"
        f"{layout.head_dim},{layout.dtype}" + (",deterministic" if layout.deterministic else "")
    ).encode()


def decode_layout(raw: bytes) -> KVLayout:
    parts = raw.decode().split(",")
    if (
        len(parts) not in (5, 6)
        or parts[4] not in DTYPE_SIZES
        or (len(parts) == 6 and parts[5] != "deterministic")
    ):
        raise ValueError(f"malformed KV layout record {raw!r}")
    return KVLayout(
        int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4], len(parts) == 6
    )


@dataclass(frozen=True, slots=True)
class Hello:
    """A sender introducing itself to a receiver."""

    sender_incarnation: str
    layout: KVLayout

    def to_bytes(self) -> bytes:
        return self.sender_incarnation.encode() + b"|" + encode_layout(self.layout)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Hello:
        incarnation, sep, layout = raw.partition(b"|")
        if not sep:
            raise ValueError(f"malformed hello {raw!r}")
        return cls(incarnation.decode(), decode_layout(layout))


@dataclass(frozen=True, slots=True)
class JobHeader:
    """Announces one transfer on a pair: what it is for and how it is cut into messages."""

    seq: int
    request_id: str
    epoch: int
    lease_token: int
    layers_per_group: int
    block_ids: tuple[int, ...]  # destination blocks

    def to_bytes(self) -> bytes:
        fixed = _JOB_FIXED.pack(
            self.seq, self.epoch, self.lease_token, self.layers_per_group, len(self.block_ids)
        )
        blocks = struct.pack(f"<{len(self.block_ids)}q", *self.block_ids)
        return fixed + blocks + self.request_id.encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> JobHeader:
        if len(raw) < _JOB_FIXED.size:
            raise ValueError(f"job header of {len(raw)} bytes is too short")
        seq, epoch, token, per_group, n = _JOB_FIXED.unpack_from(raw)
        if per_group < 1 or n < 1:
            raise ValueError(f"job header with {per_group} layers per group, {n} blocks")
        end = _JOB_FIXED.size + 8 * n
        if len(raw) < end:
            raise ValueError(f"job header of {len(raw)} bytes too short for {n} blocks")
        blocks = struct.unpack_from(f"<{n}q", raw, _JOB_FIXED.size)
        return cls(seq, raw[end:].decode(), epoch, token, per_group, tuple(blocks))


def sign_hello(key: FleetKey, receiver_incarnation: str, n: int, hello: bytes) -> bytes:
    """The store value of hello ``n`` to ``receiver_incarnation``: the hello and its tag."""
    tag = key.tag("baton/gloo-hello", receiver_incarnation, n, hello)
    return hello + b"|" + tag.hex().encode()


def open_hello(key: FleetKey | None, receiver_incarnation: str, n: int, raw: bytes) -> Hello | None:
    """The hello in a store value; None when ``key`` is set and the tag is missing or
    wrong. Raises ValueError for a malformed value."""
    if key is None:
        return Hello.from_bytes(raw)
    body, sep, tag = raw.rpartition(b"|")
    try:
        tag_bytes = bytes.fromhex(tag.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not sep or not key.check(tag_bytes, "baton/gloo-hello", receiver_incarnation, n, body):
        return None
    return Hello.from_bytes(body)


def sign_job(key: FleetKey, prefix: str, header: bytes) -> bytes:
    """A job header as stored on a pair whose receiver requires the fleet's secret."""
    return key.tag("baton/gloo-job", prefix, header) + header


def open_job(key: FleetKey | None, prefix: str, raw: bytes) -> bytes | None:
    """The header bytes of a stored job; None when the tag is missing or wrong."""
    if key is None:
        return raw
    tag, header = raw[:TAG_BYTES], raw[TAG_BYTES:]
    return header if key.check(tag, "baton/gloo-job", prefix, header) else None


_SEAL_PURPOSE = "baton/gloo-store"


def seal(key: FleetKey | None, scope: str, name: str, value: bytes) -> bytes:
    """``value`` as stored under key ``name`` by a holder of the fleet's secret: tagged over
    ``scope`` (the receiver incarnation or pair prefix it belongs to), ``name`` and the
    value. Without a key, the value itself."""
    if key is None:
        return value
    return key.tag(_SEAL_PURPOSE, scope, name, value) + value


def unseal(key: FleetKey | None, scope: str, name: str, raw: bytes) -> bytes | None:
    """The value ``seal`` stored under ``name`` for ``scope``; None when ``key`` is set and
    the tag is missing or wrong (a forged value, or one replayed from another key)."""
    if key is None:
        return raw
    tag, value = raw[:TAG_BYTES], raw[TAG_BYTES:]
    if len(tag) < TAG_BYTES or not key.check(tag, _SEAL_PURPOSE, scope, name, value):
        return None
    return value
