"""The hand-off part of the proto/domain mapping: ``Prefill`` stream messages <->
``engine.transfer.handoff`` records. Reading validates and names the field, like
``rpc.convert`` (which maps everything else).

Fleet tags (``fleet_mac``) are carried, never checked, here: they are over the records,
so the services check them on what they read. The few proto fields a reader ignores
(the echoed ``request_id`` of TransferComplete and TransferAck, FirstToken's
``finish_reason``) are outside every tag, and nothing acts on them.
"""

from __future__ import annotations

import math

from engine.transfer.handoff import (
    Ack,
    FirstToken,
    Phase,
    PrefillEvent,
    PrefillOrder,
    Progress,
    TransferDone,
)
from protos.baton.v1 import worker_pb2
from rpc.convert import (
    kv_descriptor_from_proto,
    kv_descriptor_to_proto,
    request_timings_from_proto,
    request_timings_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    token_logprob_from_proto,
    token_logprob_to_proto,
)

_PHASE_TO_PROTO = {
    Phase.QUEUED: worker_pb2.PREFILL_PHASE_QUEUED,
    Phase.PREFILLING: worker_pb2.PREFILL_PHASE_PREFILLING,
    Phase.TRANSFERRING: worker_pb2.PREFILL_PHASE_TRANSFERRING,
}
_PHASE_FROM_PROTO = {v: k for k, v in _PHASE_TO_PROTO.items()}


def prefill_order_to_proto(order: PrefillOrder) -> worker_pb2.PrefillClientMessage:
    req = worker_pb2.PrefillRequest(
        request_id=order.request_id,
        prompt_token_ids=order.prompt_token_ids,
        sampling_params=sampling_params_to_proto(order.params),
        kv=kv_descriptor_to_proto(order.descriptor),
        fleet_mac=order.mac,
    )
    if order.timeout_s is not None:
        req.timeout_s = order.timeout_s
    return worker_pb2.PrefillClientMessage(request=req)


def prefill_order_from_proto(
    msg: worker_pb2.PrefillClientMessage | None, max_model_len: int | None = None
) -> PrefillOrder:
    """The first message of a Prefill stream, validated; ValueError names the field.

    Counts are checked before anything is copied out of the message: a prompt must leave
    room for one token within ``max_model_len`` (when given), and a prompt of n tokens
    never needs more than n blocks."""
    if msg is None or msg.WhichOneof("message") != "request":
        raise ValueError("the first message of a Prefill stream must be a request")
    req = msg.request
    if not req.request_id:
        raise ValueError("request.request_id is required")
    num_prompt = len(req.prompt_token_ids)
    if not num_prompt:
        raise ValueError("request.prompt_token_ids must not be empty")
    if max_model_len is not None and num_prompt >= max_model_len:
        raise ValueError(
            f"request.prompt_token_ids has {num_prompt} tokens; max_model_len is {max_model_len}"
        )
    if len(req.kv.block_ids) > num_prompt:
        raise ValueError(
            f"request.kv.block_ids has {len(req.kv.block_ids)} blocks for {num_prompt} tokens"
        )
    if not req.HasField("kv"):
        raise ValueError("request.kv is required")
    desc = kv_descriptor_from_proto(req.kv, path="request.kv")
    if desc.request_id != req.request_id:
        raise ValueError(
            f"request.kv.request_id {desc.request_id!r} != request.request_id {req.request_id!r}"
        )
    timeout_s = req.timeout_s if req.HasField("timeout_s") else None
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s >= 0):
        raise ValueError(f"request.timeout_s must be a finite number >= 0, got {timeout_s}")
    return PrefillOrder(
        request_id=req.request_id,
        prompt_token_ids=tuple(req.prompt_token_ids),
        params=sampling_params_from_proto(req.sampling_params, path="request.sampling_params"),
        descriptor=desc,
        timeout_s=timeout_s,
        mac=req.fleet_mac,
    )


def prefill_event_to_proto(request_id: str, event: PrefillEvent) -> worker_pb2.PrefillServerMessage:
    if isinstance(event, Progress):
        return worker_pb2.PrefillServerMessage(
            progress=worker_pb2.PrefillProgress(
                phase=_PHASE_TO_PROTO[event.phase],
                num_computed_tokens=event.num_computed_tokens,
                fleet_mac=event.mac,
            )
        )
    if isinstance(event, FirstToken):
        first = worker_pb2.FirstToken(
            token_id=event.token_id,
            num_cached_tokens=event.num_cached_tokens,
            sender_incarnation_id=event.sender_incarnation,
            fleet_mac=event.mac,
            prompt_logprobs=[token_logprob_to_proto(lp) for lp in event.prompt_logprobs],
        )
        if event.logprob is not None:
            first.logprob.CopyFrom(token_logprob_to_proto(event.logprob))
        return worker_pb2.PrefillServerMessage(first_token=first)
    assert isinstance(event, TransferDone)
    done = worker_pb2.TransferComplete(
        request_id=request_id,
        checksum=event.checksum,
        epoch=event.epoch,
        num_bytes=event.num_bytes,
        fleet_mac=event.mac,
    )
    if event.timings is not None:
        done.timings.CopyFrom(request_timings_to_proto(event.timings))
    return worker_pb2.PrefillServerMessage(transfer_complete=done)


def prefill_event_from_proto(msg: worker_pb2.PrefillServerMessage) -> PrefillEvent:
    """A prefill worker's message; ValueError for one that breaks the protocol."""
    which = msg.WhichOneof("message")
    if which == "progress":
        phase = _PHASE_FROM_PROTO.get(msg.progress.phase)
        if phase is None:
            raise ValueError(f"progress.phase {msg.progress.phase!r} is not a known phase")
        return Progress(phase, msg.progress.num_computed_tokens, msg.progress.fleet_mac)
    if which == "first_token":
        first = msg.first_token
        logprob = token_logprob_from_proto(first.logprob) if first.HasField("logprob") else None
        return FirstToken(
            token_id=first.token_id,
            logprob=logprob,
            num_cached_tokens=first.num_cached_tokens,
            sender_incarnation=first.sender_incarnation_id,
            mac=first.fleet_mac,
            prompt_logprobs=tuple(token_logprob_from_proto(lp) for lp in first.prompt_logprobs),
        )
    if which == "transfer_complete":
        done = msg.transfer_complete
        timings = None
        if done.HasField("timings"):
            timings = request_timings_from_proto(done.timings, path="transfer_complete.timings")
        return TransferDone(done.checksum, done.epoch, done.num_bytes, done.fleet_mac, timings)
    raise ValueError(
        "a Prefill stream message must set one of progress, first_token, transfer_complete"
    )


def ack_to_proto(request_id: str, ack: Ack) -> worker_pb2.PrefillClientMessage:
    return worker_pb2.PrefillClientMessage(
        ack=worker_pb2.TransferAck(
            request_id=request_id, ok=ack.ok, reason=ack.reason, fleet_mac=ack.mac
        )
    )


def ack_from_proto(msg: worker_pb2.PrefillClientMessage | None) -> Ack | None:
    """The decode worker's verdict, or None when it ended the stream without one."""
    if msg is None or msg.WhichOneof("message") != "ack":
        return None
    return Ack(msg.ack.ok, msg.ack.reason, msg.ack.fleet_mac)
