"""The fleet's shared secret: proof that a KV hand-off peer belongs to this deployment.

mTLS decides who may open a gRPC connection; this decides who may take part in a KV
hand-off, including over channels TLS does not cover (the gloo/nccl rendezvous store is a
plain TCP key-value store anyone who reaches it can write). Every message that commits a
peer to act carries an HMAC-SHA256 tag under the secret, over what it commits to:

- every message of a ``Prefill`` stream (``engine.transfer.handoff``), over all of its
  fields (``engine.transfer.canonical``): the order (decode -> prefill: request id,
  prompt, sampling parameters, time limit and the whole KV descriptor), so a prefill
  worker runs only what a decode worker of the fleet asked and writes KV only where it
  asked; progress beats, the first token and the transfer report (prefill -> decode) and
  the ack (decode -> prefill), each bound to the request and its lease, so a decode
  worker runs only KV a prefill worker of the fleet vouched for;
- the gloo/nccl hello (sender -> receiver's store): the receiver incarnation, the hello
  number and the hello itself, so only the fleet's senders get a pair group;
- each job header on a pair: the pair and the header.

A party with no key (no ``--fleet-secret-file``) neither signs nor checks. Tags are
compared with ``hmac.compare_digest``; the secret is never logged. Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from pathlib import Path

MIN_SECRET_BYTES = 16
TAG_BYTES = 32  # SHA-256

Part = bytes | str | int | Sequence[int]


class FleetKey:
    """The shared secret. ``repr`` never shows it."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the fleet secret must have at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret

    @classmethod
    def from_file(cls, path: Path, flag: str = "--fleet-secret-file") -> FleetKey:
        """The secret in ``path`` (surrounding whitespace dropped); ValueError names the
        flag, never the contents."""
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as err:
            raise ValueError(f"{flag}={str(path)!r} cannot be read: {err.strerror}") from err
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"{flag}={str(path)!r} holds {len(secret)} bytes; at least "
                f"{MIN_SECRET_BYTES} are required"
            )
        return cls(secret)

    def __repr__(self) -> str:
        return "FleetKey(<secret>)"

    def tag(self, purpose: str, *parts: Part) -> bytes:
        """HMAC-SHA256 over ``purpose`` and ``parts``, each length-prefixed, so no two
        different part lists give the same input."""
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (purpose, *parts):
            data = _encode(part)
            mac.update(struct.pack("<Q", len(data)))
            mac.update(data)
        return mac.digest()

    def check(self, tag: bytes, purpose: str, *parts: Part) -> bool:
        """True when ``tag`` is ``self.tag(purpose, *parts)`` (constant time)."""
        return hmac.compare_digest(tag, self.tag(purpose, *parts))


def _encode(part: Part) -> bytes:
    if isinstance(part, bytes):
        return part
    if isinstance(part, str):
        return part.encode("utf-8", "surrogatepass")
    if isinstance(part, int):
        return struct.pack("<q", part) if part < 2**63 else struct.pack("<Q", part)
    # A token or block id list: packed, then hashed, so a long prompt costs one pass.
    return hashlib.sha256(struct.pack(f"<{len(part)}q", *part)).digest()
