"""The records of the KV hand-off protocol between a decode and a prefill worker.

One ``Prefill`` stream per request carries, from decode to prefill, a ``PrefillOrder``
then an ``Ack``; from prefill to decode, ``Progress`` beats while the request waits,
prefills or transfers, one ``FirstToken`` and one ``TransferDone``:

    decode                                   prefill
    reserve blocks, lease them
    PrefillOrder(descriptor)  ───────────▶   queue, prefill (hold the KV)
                              ◀───────────   Progress ...      (every beat with progress)
                              ◀───────────   FirstToken        (sampled at position 0)
                              ◀───────────   Progress ...      (while the copy runs)
                              ◀───────────   TransferDone(checksum, epoch)
    verify, wait for the lease to end
    Ack(ok)                   ───────────▶   free the source blocks
    kv_ready -> decode

The lease's deadline moves forward with every ``Progress``, so the bound is on a peer
that stops making progress, never on how long a long prompt takes to prefill. The
protocol logic lives in ``decode_service.handoff`` and ``prefill_service.handoff``. With a
fleet secret (``engine.transfer.fleet_auth``) the order and TransferDone carry tags
(``order_tag``, ``done_tag``) and a peer without the secret is refused;
rpc/convert maps these records to and from protos. Torch-free.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass

from engine.request import RequestTimings, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.transfer.base import KVDescriptor
from engine.transfer.fleet_auth import FleetKey


class Phase(enum.Enum):
    """Where a request is on the prefill worker."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"


@dataclass(frozen=True, slots=True)
class PrefillOrder:
    """Decode's request: run this prompt and write its KV into the leased blocks."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    descriptor: KVDescriptor
    # ``order_tag`` under the fleet's secret; empty when the fleet has none.
    mac: bytes = b""


@dataclass(frozen=True, slots=True)
class Progress:
    """The prefill worker is alive and moving (its engine stepped, or the copy advanced)."""

    phase: Phase
    num_computed_tokens: int  # of this request's prompt


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The token sampled at output position 0, sent before the transfer completes."""

    token_id: int
    logprob: TokenLogprob | None
    num_cached_tokens: int  # prompt tokens prefill served from its prefix cache
    sender_incarnation: str  # the prefill worker's KV sender, for decode's peer state


@dataclass(frozen=True, slots=True)
class TransferDone:
    """The KV is written; decode verifies it against these."""

    checksum: int
    epoch: int
    num_bytes: int
    # ``done_tag`` under the fleet's secret; empty when the fleet has none.
    mac: bytes = b""
    # The prefill worker's phases of the request (queued, prefill, transfer); reported
    # for the request's timings, never trusted for a decision (so not signed).
    timings: RequestTimings | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    """Decode's verdict; the prefill worker frees its source blocks on it."""

    ok: bool
    reason: str = ""


# What a prefill worker sends on the stream.
PrefillEvent = Progress | FirstToken | TransferDone


def order_tag(key: FleetKey, order: PrefillOrder) -> bytes:
    """What decode signs: the request, its prompt and the lease it grants."""
    desc = order.descriptor
    return key.tag(
        "baton/prefill-order",
        order.request_id,
        order.prompt_token_ids,
        desc.endpoint.kind,
        desc.endpoint.address,
        desc.endpoint.incarnation,
        desc.lease_token,
        desc.epoch,
        desc.block_ids,
    )


def done_tag(key: FleetKey, request_id: str, lease_token: int, done: TransferDone) -> bytes:
    """What prefill signs: the KV it wrote for the lease, by checksum and size."""
    return key.tag(
        "baton/transfer-done",
        request_id,
        lease_token,
        done.epoch,
        done.checksum,
        done.num_bytes,
    )


def order_is_signed(key: FleetKey, order: PrefillOrder) -> bool:
    """True when ``order.mac`` is the fleet's tag of it (constant-time compare)."""
    return hmac.compare_digest(order.mac, order_tag(key, order))


def done_is_signed(key: FleetKey, request_id: str, lease_token: int, done: TransferDone) -> bool:
    """True when ``done.mac`` is the fleet's tag of it for this lease."""
    return hmac.compare_digest(done.mac, done_tag(key, request_id, lease_token, done))
