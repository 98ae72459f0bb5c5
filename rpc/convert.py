"""The one mapping between wire messages (``protos/baton/v1``) and engine records.

Servicers stay thin: proto -> domain here, domain -> engine -> domain, domain -> proto
here. Reading from the wire validates: a bad value raises ``ValueError`` whose message
starts with the proto field's path (``sampling_params.top_p must be in (0, 1] ...``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.kv_layout import KVLayout
from engine.request import FinishReason, RequestOutput, RequestTimings, TokenLogprob
from engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams
from engine.stats import EngineStats
from engine.transfer.base import KVDescriptor, KVEndpoint
from protos.baton.v1 import common_pb2, kv_pb2, worker_pb2
from rpc.convert_constraint import constraint_from_proto, constraint_to_proto

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
# SamplingParams fields that are `optional` scalars on the wire (all but the repeated
# stop_token_ids, the logit_bias map and the constraint, a oneof: rpc.convert_constraint).
_OPTIONAL_SCALARS = tuple(
    name for name in _SAMPLING_FIELDS if name not in ("stop_token_ids", "logit_bias", "constraint")
)

_FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO: dict[int, FinishReason | None] = {
    int(v): k for k, v in _FINISH_TO_PROTO.items()
}
# The engine has no stop strings (the gateway applies them); for it, they are a STOP.
_FINISH_FROM_PROTO[common_pb2.FINISH_REASON_STOP_STRING] = FinishReason.STOP

_DTYPE_TO_PROTO = {
    "float32": kv_pb2.KV_DTYPE_FLOAT32,
    "bfloat16": kv_pb2.KV_DTYPE_BFLOAT16,
    "float16": kv_pb2.KV_DTYPE_FLOAT16,
}
_DTYPE_FROM_PROTO = {v: k for k, v in _DTYPE_TO_PROTO.items()}

_TIMING_FIELDS = tuple(f.name for f in dataclasses.fields(RequestTimings))


def _field_error(path: str, exc: ValueError) -> ValueError:
    """``exc`` re-worded so its message starts with ``path`` + the field it names."""
    message = str(exc)
    for name in _SAMPLING_FIELDS:
        if message.startswith(name):
            return ValueError(f"{path}.{message}")
    return ValueError(f"{path}: {message}")


# --- sampling parameters -------------------------------------------------------------


def sampling_params_from_proto(
    msg: common_pb2.SamplingParameters, *, path: str = "sampling_params"
) -> SamplingParams:
    """Validated SamplingParams; unset fields take the dataclass defaults.

    Raises ValueError naming ``path.<field>`` for any out-of-range value.
    """
    values: dict[str, Any] = {
        name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)
    }
    if msg.stop_token_ids:
        if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # counted before it is copied
            raise ValueError(
                f"{path}.stop_token_ids has {len(msg.stop_token_ids)} entries; at most "
                f"{MAX_STOP_TOKEN_IDS} allowed"
            )
        values["stop_token_ids"] = tuple(msg.stop_token_ids)
    values["constraint"] = constraint_from_proto(msg, path=path)
    if msg.logit_bias:
        if len(msg.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"{path}.logit_bias has {len(msg.logit_bias)} entries; at most "
                f"{MAX_LOGIT_BIAS} allowed"
            )
        values["logit_bias"] = tuple(msg.logit_bias.items())
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise _field_error(path, exc) from exc


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParameters:
    """Every field set explicitly, so the receiver never falls back on its own defaults
    (``seed`` and ``logprobs`` stay unset when None)."""
    msg = common_pb2.SamplingParameters(
        stop_token_ids=params.stop_token_ids, logit_bias=dict(params.logit_bias)
    )
    for name in _OPTIONAL_SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    constraint_to_proto(params.constraint, msg)
    return msg


# --- finish reason, log-probabilities, usage -----------------------------------------


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int, *, path: str = "finish_reason") -> FinishReason | None:
    """None for UNSPECIFIED (not finished); STOP_STRING reads as STOP."""
    try:
        return _FINISH_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"{path} has unknown value {value!r}") from None


def token_logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
    )


def token_logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=msg.token_id,
        logprob=msg.logprob,
        rank=msg.rank,
        top=[(t.token_id, t.logprob) for t in msg.top],
    )


def usage_to_proto(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, migrations: int = 0
) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        migrations=migrations,
    )


def request_timings_to_proto(timings: RequestTimings) -> common_pb2.RequestTimings:
    return common_pb2.RequestTimings(**timings.as_dict())


def request_timings_from_proto(
    msg: common_pb2.RequestTimings, *, path: str = "timings"
) -> RequestTimings:
    """The phases set in ``msg``; ValueError for one that is negative or not finite."""
    known: dict[str, float] = {}
    for name in _TIMING_FIELDS:
        if msg.HasField(name):
            value = getattr(msg, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{path}.{name} must be a finite number >= 0, got {value}")
            known[name] = value
    return RequestTimings(**known)


# --- request outputs -----------------------------------------------------------------


def decode_response_from_output(
    out: RequestOutput, *, completion_tokens: int
) -> worker_pb2.DecodeResponse:
    """One engine delta as a DecodeResponse. ``completion_tokens`` is the request's total
    so far (the output is a delta and does not know it); it goes into ``usage``, which
    is set only when ``out`` is the last output."""
    msg = worker_pb2.DecodeResponse(
        token_ids=out.new_token_ids,
        logprobs=[token_logprob_to_proto(lp) for lp in out.logprobs or ()],
        finish_reason=finish_reason_to_proto(out.finish_reason),
        prompt_logprobs=[token_logprob_to_proto(lp) for lp in out.prompt_logprobs or ()],
        index=out.index,
    )
    if out.finished:
        msg.usage.CopyFrom(
            usage_to_proto(out.num_prompt_tokens, completion_tokens, out.num_cached_tokens)
        )
    if out.timings is not None:
        msg.timings.CopyFrom(request_timings_to_proto(out.timings))
    return msg


def output_from_decode_response(request_id: str, msg: worker_pb2.DecodeResponse) -> RequestOutput:
    """The inverse of :func:`decode_response_from_output` (empty logprobs read as None)."""
    usage = msg.usage if msg.HasField("usage") else None
    return RequestOutput(
        request_id=request_id,
        new_token_ids=list(msg.token_ids),
        logprobs=[token_logprob_from_proto(lp) for lp in msg.logprobs] or None,
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        num_prompt_tokens=usage.prompt_tokens if usage is not None else 0,
        num_cached_tokens=usage.cached_tokens if usage is not None else 0,
        timings=request_timings_from_proto(msg.timings) if msg.HasField("timings") else None,
        prompt_logprobs=[token_logprob_from_proto(lp) for lp in msg.prompt_logprobs] or None,
        index=msg.index,
    )


def first_token_from_output(out: RequestOutput) -> worker_pb2.FirstToken:
    """Prefill's first output (exactly one new token) as a FirstToken."""
    if len(out.new_token_ids) != 1:
        raise ValueError(
            f"request {out.request_id}: a first token output carries exactly one token, "
            f"got {len(out.new_token_ids)}"
        )
    msg = worker_pb2.FirstToken(
        token_id=out.new_token_ids[0],
        num_cached_tokens=out.num_cached_tokens,
        finish_reason=finish_reason_to_proto(out.finish_reason),
        prompt_logprobs=[token_logprob_to_proto(lp) for lp in out.prompt_logprobs or ()],
    )
    if out.logprobs:
        msg.logprob.CopyFrom(token_logprob_to_proto(out.logprobs[0]))
    return msg


def output_from_first_token(
    request_id: str, msg: worker_pb2.FirstToken, *, num_prompt_tokens: int
) -> RequestOutput:
    """The inverse of :func:`first_token_from_output`."""
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[msg.token_id],
        logprobs=[token_logprob_from_proto(msg.logprob)] if msg.HasField("logprob") else None,
        finish_reason=finish_reason_from_proto(msg.finish_reason, path="first_token.finish_reason"),
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        prompt_logprobs=[token_logprob_from_proto(lp) for lp in msg.prompt_logprobs] or None,
    )


# --- KV layout -----------------------------------------------------------------------


def kv_layout_to_proto(layout: KVLayout) -> kv_pb2.KVLayout:
    return kv_pb2.KVLayout(
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=_DTYPE_TO_PROTO[layout.dtype],
        deterministic=layout.deterministic,
    )


def kv_layout_from_proto(msg: kv_pb2.KVLayout, *, path: str = "layout") -> KVLayout:
    """Validated KVLayout; raises ValueError naming ``path.<field>``."""
    dtype = _DTYPE_FROM_PROTO.get(msg.dtype)
    if dtype is None:
        allowed = [kv_pb2.KVDtype.Name(v) for v in _DTYPE_FROM_PROTO]
        raise ValueError(f"{path}.dtype must be one of {allowed}, got {msg.dtype!r}")
    for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
        value = getattr(msg, name)
        if value < 1:
            raise ValueError(f"{path}.{name} must be >= 1, got {value}")
    return KVLayout(
        num_layers=msg.num_layers,
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=dtype,
        deterministic=msg.deterministic,
    )


# --- KV descriptor -------------------------------------------------------------------

_TRANSPORT_TO_PROTO = {
    "shm": kv_pb2.KV_TRANSPORT_SHM,
    "gloo": kv_pb2.KV_TRANSPORT_GLOO,
    "cuda_ipc": kv_pb2.KV_TRANSPORT_CUDA_IPC,
    "nccl": kv_pb2.KV_TRANSPORT_NCCL,
    "nixl": kv_pb2.KV_TRANSPORT_NIXL,
}
_TRANSPORT_FROM_PROTO = {v: k for k, v in _TRANSPORT_TO_PROTO.items()}


def kv_descriptor_to_proto(desc: KVDescriptor) -> kv_pb2.KVDescriptor:
    ep = desc.endpoint
    return kv_pb2.KVDescriptor(
        transport=_TRANSPORT_TO_PROTO[ep.kind],
        endpoint=ep.address,
        block_ids=list(desc.block_ids),
        layout=kv_layout_to_proto(ep.layout),
        incarnation_id=ep.incarnation,
        block_epoch=desc.epoch,
        request_id=desc.request_id,
        num_blocks=ep.num_blocks,
        lease_token=desc.lease_token,
        handle=ep.handle,
        first_block=desc.first_block,
    )


def kv_descriptor_from_proto(msg: kv_pb2.KVDescriptor, *, path: str = "kv") -> KVDescriptor:
    """Validated descriptor; raises ValueError naming ``path.<field>``."""
    kind = _TRANSPORT_FROM_PROTO.get(msg.transport)
    if kind is None:
        allowed = [kv_pb2.KVTransport.Name(v) for v in _TRANSPORT_FROM_PROTO]
        raise ValueError(f"{path}.transport must be one of {allowed}, got {msg.transport!r}")
    if not msg.HasField("layout"):
        raise ValueError(f"{path}.layout is required")
    if not msg.incarnation_id:
        raise ValueError(f"{path}.incarnation_id is required")
    if not msg.request_id:
        raise ValueError(f"{path}.request_id is required")
    if msg.lease_token == 0:
        raise ValueError(f"{path}.lease_token must be non-zero")
    if not msg.block_ids:
        raise ValueError(f"{path}.block_ids must not be empty")
    for i, b in enumerate(msg.block_ids):
        if b >= msg.num_blocks:
            raise ValueError(
                f"{path}.block_ids[{i}] is {b}, outside the pool of {msg.num_blocks} blocks"
            )
    endpoint = KVEndpoint(
        kind=kind,
        address=msg.endpoint,
        incarnation=msg.incarnation_id,
        layout=kv_layout_from_proto(msg.layout, path=f"{path}.layout"),
        num_blocks=msg.num_blocks,
        handle=bytes(msg.handle),
    )
    return KVDescriptor(
        endpoint=endpoint,
        request_id=msg.request_id,
        block_ids=tuple(msg.block_ids),
        epoch=msg.block_epoch,
        lease_token=msg.lease_token,
        first_block=msg.first_block,
    )


# --- worker stats --------------------------------------------------------------------

_ROLE_TO_PROTO = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "both": worker_pb2.WORKER_ROLE_BOTH,
}


def worker_stats_to_proto(
    role: str, incarnation: str, stats: EngineStats, busy_fraction: float, layout: KVLayout
) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        role=_ROLE_TO_PROTO[role],
        incarnation_id=incarnation,
        total_kv_blocks=stats.num_total_blocks,
        free_kv_blocks=stats.num_free_blocks,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_waiting_for_kv=stats.num_waiting_for_kv,
        queued_prompt_tokens=stats.num_queued_prompt_tokens,
        busy_fraction=busy_fraction,
        prefix_cache_hit_tokens=stats.prefix_hit_tokens,
        held_kv_blocks=stats.num_held_blocks,
        kv_layout=kv_layout_to_proto(layout),
        max_num_seqs=stats.max_num_seqs,
        max_queued_requests=stats.max_queued_requests,
        cpu_kernel_routes=dict(stats.cpu_kernel_routes),
        core_group=stats.core_group,
    )
