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
protocol logic lives in ``decode_service.handoff`` and ``prefill_service.handoff``.

With a fleet secret (``engine.transfer.fleet_auth``) every message of the stream carries
a tag in its ``mac`` field, and a peer with the secret acts on none whose tag does not
check. A tag is over the message's canonical encoding (``engine.transfer.canonical``):
every field at every depth but ``mac`` itself, so a field added to a record later is
signed without anyone listing it. The order's tag stands alone; the tag of every later
message (``message_tag``) also covers the request id and the lease token, so it is good
for that one lease only. rpc/convert_handoff maps these records to and from protos.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
from dataclasses import dataclass

from engine.request import RequestTimings, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.transfer.base import KVDescriptor
from engine.transfer.canonical import canonical
from engine.transfer.fleet_auth import FleetKey

# What each tag is for; "v2": tags over every field. Every worker of a fleet must run the
# same version: a v1 worker's tags (over a hand-picked list of fields) never check here.
ORDER_PURPOSE = "baton/prefill-order/v2"
MESSAGE_PURPOSE = "baton/handoff-message/v2"


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
    # Seconds left to the client's deadline when decode sent the order (None: no
    # deadline). Signed with the rest, so the prefill worker's bound on the request never
    # rests on the transport's deadline alone.
    timeout_s: float | None = None
    # ``order_tag`` under the fleet's secret; empty when the fleet has none.
    mac: bytes = b""


@dataclass(frozen=True, slots=True)
class Progress:
    """The prefill worker is alive and moving (its engine stepped, or the copy advanced)."""

    phase: Phase
    num_computed_tokens: int  # of this request's prompt
    # ``message_tag`` under the fleet's secret; empty when the fleet has none.
    mac: bytes = b""


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The token sampled at output position 0, sent before the transfer completes."""

    token_id: int
    logprob: TokenLogprob | None
    num_cached_tokens: int  # prompt tokens prefill served from its prefix cache
    sender_incarnation: str  # the prefill worker's KV sender, for decode's peer state
    # ``message_tag`` under the fleet's secret; empty when the fleet has none.
    mac: bytes = b""
    # One per prompt token after the first, when the request asked for prompt logprobs.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class TransferDone:
    """The KV is written; decode verifies it against these."""

    checksum: int
    epoch: int
    num_bytes: int
    # ``message_tag`` under the fleet's secret; empty when the fleet has none.
    mac: bytes = b""
    # The prefill worker's phases of the request (queued, prefill, transfer); reported
    # for the request's timings, never trusted for a decision (signed all the same, as
    # every field is).
    timings: RequestTimings | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    """Decode's verdict; the prefill worker frees its source blocks on it."""

    ok: bool
    reason: str = ""
    # ``message_tag`` under the fleet's secret; empty when the fleet has none.
    mac: bytes = b""


# What a prefill worker sends on the stream.
PrefillEvent = Progress | FirstToken | TransferDone
# Every message of a stream after the order, both ways.
HandoffMessage = Progress | FirstToken | TransferDone | Ack


def order_tag(key: FleetKey, order: PrefillOrder) -> bytes:
    """What decode signs: the whole order but its tag, i.e. the request id, the prompt,
    the sampling parameters, the time limit and the whole KV descriptor (transport,
    endpoint address, incarnation, layout, pool size, cuda_ipc handle, block ids, epoch
    and lease token)."""
    return key.tag(ORDER_PURPOSE, canonical(dataclasses.replace(order, mac=b"")))


def message_tag(key: FleetKey, request_id: str, lease_token: int, message: HandoffMessage) -> bytes:
    """What either side signs after the order: the whole message but its tag, bound to
    the request and the lease it belongs to, so it cannot be replayed on another one."""
    body = canonical(dataclasses.replace(message, mac=b""))
    return key.tag(MESSAGE_PURPOSE, request_id, lease_token, body)


def order_is_signed(key: FleetKey, order: PrefillOrder) -> bool:
    """True when ``order.mac`` is the fleet's tag of it (constant-time compare)."""
    return hmac.compare_digest(order.mac, order_tag(key, order))


def message_is_signed(
    key: FleetKey, request_id: str, lease_token: int, message: HandoffMessage
) -> bool:
    """True when ``message.mac`` is the fleet's tag of it for this lease."""
    return hmac.compare_digest(message.mac, message_tag(key, request_id, lease_token, message))


def done_tag(key: FleetKey, request_id: str, lease_token: int, done: TransferDone) -> bytes:
    """``message_tag`` of a transfer report."""
    return message_tag(key, request_id, lease_token, done)


def done_is_signed(key: FleetKey, request_id: str, lease_token: int, done: TransferDone) -> bool:
    """``message_is_signed`` for a transfer report."""
    return message_is_signed(key, request_id, lease_token, done)
