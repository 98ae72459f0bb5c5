"""What the ``nixl`` transport's peers tell each other, and how a lease becomes descriptors.

Decode's agent metadata and the address of its registered pool travel in the
``KVEndpoint.handle`` of every descriptor (``PoolHandle``), so inside the order that the
fleet's secret signs; nothing else is exchanged out of band. Everything after that goes
as NIXL notifications between the two agents (``Message``):

    sender (prefill)                             receiver (decode)
    HELLO(its metadata, layout, liveness) ──▶    load the sender's metadata
                                          ◀──    WELCOME or REFUSE(reason)
    CLAIM(token, epoch, request, blocks)  ──▶    lease live and as claimed: mark it busy
                                          ◀──    GRANT or REFUSE(reason)
    WRITE ... notification DONE(token)    ──▶    data landed: not busy, arrived
    RELEASE(token, reason)                ──▶    stopped without DONE: not busy, lease ends
                                          ◀──    REVOKE(token)  (the lease ended: stop)
    PING                                  ──▶    (ignored: the sender probes an idle link)

With a fleet secret every message carries a tag over its kind, both incarnations and its
body, so no party outside the fleet can forge a grant, a claim or an arrival. A lease's
blocks are written only between its GRANT and its DONE or RELEASE; the receiver never
ends a lease whose grant stands (quarantine), which is what makes a late write
impossible. Torch-free.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from engine.kv_layout import KVLayout
from engine.transfer.fleet_auth import TAG_BYTES, FleetKey
from engine.transfer.store_protocol import decode_layout, encode_layout

PURPOSE = "baton/nixl-message/v1"
_MAGIC = b"BXN1"
_HANDLE_MAGIC = b"BXH1"
_LEN = struct.Struct("<I")
_HANDLE_FIXED = struct.Struct("<4sBBqQ")  # magic, proof bytes, mem type, device id, address
PROOF_PURPOSE = "baton/nixl-receiver/v1"

HELLO, WELCOME, CLAIM, GRANT, REFUSE, DONE, RELEASE, REVOKE, PING = (
    b"H",
    b"W",
    b"C",
    b"G",
    b"X",
    b"D",
    b"R",
    b"V",
    b"P",  # a sender probing an idle link: UCX refuses it once the receiver is gone
)
KINDS = (HELLO, WELCOME, CLAIM, GRANT, REFUSE, DONE, RELEASE, REVOKE, PING)
MEM_TYPES = ("DRAM", "VRAM")


def receiver_agent_name(incarnation: str) -> str:
    return f"baton-kv-rx-{incarnation}"


def sender_agent_name(incarnation: str) -> str:
    return f"baton-kv-tx-{incarnation}"


@dataclass(frozen=True, slots=True)
class PoolHandle:
    """The endpoint handle of a nixl receiver: how to write into its registered pool."""

    metadata: bytes  # the receiver agent's NIXL metadata (connection info, registrations)
    address: int  # where the pool starts in the receiver's address space
    mem_type: str  # DRAM | VRAM
    device_id: int  # the CUDA device of a VRAM pool; 0 for DRAM
    # With a fleet secret: ``proof(key, incarnation, metadata)``, so a sender holding
    # another secret knows at once (the receiver would drop its hello unanswered); the
    # receiver then admits only senders whose messages carry the secret. Empty: no secret.
    proof: bytes = b""

    def to_bytes(self) -> bytes:
        fixed = _HANDLE_FIXED.pack(
            _HANDLE_MAGIC,
            len(self.proof),
            MEM_TYPES.index(self.mem_type),
            self.device_id,
            self.address,
        )
        return fixed + self.proof + self.metadata

    @classmethod
    def from_bytes(cls, raw: bytes) -> PoolHandle:
        if len(raw) < _HANDLE_FIXED.size:
            raise ValueError(f"nixl endpoint handle of {len(raw)} bytes is too short")
        magic, proof_len, mem, device, address = _HANDLE_FIXED.unpack_from(raw)
        if magic != _HANDLE_MAGIC or mem >= len(MEM_TYPES) or proof_len not in (0, TAG_BYTES):
            raise ValueError("the endpoint handle is not a baton nixl pool handle")
        end = _HANDLE_FIXED.size + proof_len
        return cls(raw[end:], address, MEM_TYPES[mem], device, raw[_HANDLE_FIXED.size : end])


def proof(key: FleetKey, incarnation: str, metadata: bytes) -> bytes:
    """The receiver's tag over its incarnation and agent metadata."""
    return key.tag(PROOF_PURPOSE, incarnation, metadata)


@dataclass(frozen=True, slots=True)
class Message:
    """One notification between a sender and a receiver incarnation."""

    kind: bytes  # one of KINDS
    receiver: str  # receiver incarnation
    sender: str  # sender incarnation
    token: int = 0  # the lease token (0 for HELLO / WELCOME)
    fields: tuple[bytes, ...] = ()  # kind-specific

    def encode(self, key: FleetKey | None) -> bytes:
        body = bytearray(_MAGIC + self.kind)
        for part in (self.receiver.encode(), self.sender.encode(), struct.pack("<q", self.token)):
            body += _LEN.pack(len(part)) + part
        for part in self.fields:
            body += _LEN.pack(len(part)) + part
        tag = key.tag(PURPOSE, bytes(body)) if key is not None else b""
        return bytes(body) + tag

    @classmethod
    def decode(cls, raw: bytes, key: FleetKey | None) -> Message:
        """The message in ``raw``; ValueError if it is malformed or, with a key, not
        tagged with it."""
        if raw[:4] != _MAGIC or raw[4:5] not in KINDS:
            raise ValueError("not a baton nixl message")
        body = raw[: len(raw) - TAG_BYTES] if key is not None else raw
        if key is not None and not key.check(raw[len(body) :], PURPOSE, body):
            raise ValueError("message does not carry the fleet's secret")
        pos = 5
        parts: list[bytes] = []

        def take() -> bytes:
            nonlocal pos
            if pos + _LEN.size > len(body):
                raise ValueError("truncated nixl message")
            (n,) = _LEN.unpack_from(body, pos)
            pos += _LEN.size
            if pos + n > len(body):
                raise ValueError("truncated nixl message")
            pos += n
            return bytes(body[pos - n : pos])

        receiver, sender, token = take(), take(), take()
        while pos < len(body):
            parts.append(take())
        if len(token) != 8:
            raise ValueError("malformed token in nixl message")
        return cls(
            raw[4:5],
            receiver.decode(),
            sender.decode(),
            struct.unpack("<q", token)[0],
            tuple(parts),
        )


def hello_fields(
    metadata: bytes, layout: KVLayout, writer_id: int, host_id: str
) -> tuple[bytes, ...]:
    return (metadata, encode_layout(layout), struct.pack("<q", writer_id), host_id.encode())


@dataclass(frozen=True, slots=True)
class Hello:
    metadata: bytes
    layout: KVLayout
    writer_id: int
    host_id: str

    @classmethod
    def from_message(cls, msg: Message) -> Hello:
        if len(msg.fields) != 4 or len(msg.fields[2]) != 8:
            raise ValueError("malformed nixl hello")
        return cls(
            msg.fields[0],
            decode_layout(msg.fields[1]),
            struct.unpack("<q", msg.fields[2])[0],
            msg.fields[3].decode(),
        )


def claim_fields(request_id: str, epoch: int, block_ids: tuple[int, ...]) -> tuple[bytes, ...]:
    return (
        request_id.encode(),
        struct.pack("<q", epoch),
        struct.pack(f"<{len(block_ids)}q", *block_ids),
    )


def parse_claim(msg: Message) -> tuple[str, int, tuple[int, ...]]:
    if len(msg.fields) != 3 or len(msg.fields[1]) != 8 or len(msg.fields[2]) % 8:
        raise ValueError("malformed nixl claim")
    ids = struct.unpack(f"<{len(msg.fields[2]) // 8}q", msg.fields[2])
    return msg.fields[0].decode(), struct.unpack("<q", msg.fields[1])[0], tuple(ids)


def block_runs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` for each run of blocks consecutive on both sides,
    in job order: the fewest pieces the two pools' layouts allow a lease to move in."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
