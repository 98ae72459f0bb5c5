from protos.baton.v1 import common_pb2 as _common_pb2
from protos.baton.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_PHASE_UNSPECIFIED: _ClassVar[PrefillPhase]
    PREFILL_PHASE_QUEUED: _ClassVar[PrefillPhase]
    PREFILL_PHASE_PREFILLING: _ClassVar[PrefillPhase]
    PREFILL_PHASE_TRANSFERRING: _ClassVar[PrefillPhase]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
PREFILL_PHASE_UNSPECIFIED: PrefillPhase
PREFILL_PHASE_QUEUED: PrefillPhase
PREFILL_PHASE_PREFILLING: PrefillPhase
PREFILL_PHASE_TRANSFERRING: PrefillPhase
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "kv", "fleet_mac", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FLEET_MAC_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParameters
    kv: _kv_pb2.KVDescriptor
    fleet_mac: bytes
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParameters, _Mapping]] = ..., kv: _Optional[_Union[_kv_pb2.KVDescriptor, _Mapping]] = ..., fleet_mac: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("request_id", "ok", "reason", "fleet_mac")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FLEET_MAC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    reason: str
    fleet_mac: bytes
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ..., fleet_mac: _Optional[bytes] = ...) -> None: ...

class PrefillClientMessage(_message.Message):
    __slots__ = ("request", "ack")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    request: PrefillRequest
    ack: TransferAck
    def __init__(self, request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., ack: _Optional[_Union[TransferAck, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "num_cached_tokens", "finish_reason", "sender_incarnation_id", "fleet_mac", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SENDER_INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    FLEET_MAC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    finish_reason: _common_pb2.FinishReason
    sender_incarnation_id: str
    fleet_mac: bytes
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., sender_incarnation_id: _Optional[str] = ..., fleet_mac: _Optional[bytes] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("phase", "num_computed_tokens", "fleet_mac")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FLEET_MAC_FIELD_NUMBER: _ClassVar[int]
    phase: PrefillPhase
    num_computed_tokens: int
    fleet_mac: bytes
    def __init__(self, phase: _Optional[_Union[PrefillPhase, str]] = ..., num_computed_tokens: _Optional[int] = ..., fleet_mac: _Optional[bytes] = ...) -> None: ...

class TransferComplete(_message.Message):
    __slots__ = ("request_id", "checksum", "epoch", "num_bytes", "fleet_mac", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLEET_MAC_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    checksum: int
    epoch: int
    num_bytes: int
    fleet_mac: bytes
    timings: _common_pb2.RequestTimings
    def __init__(self, request_id: _Optional[str] = ..., checksum: _Optional[int] = ..., epoch: _Optional[int] = ..., num_bytes: _Optional[int] = ..., fleet_mac: _Optional[bytes] = ..., timings: _Optional[_Union[_common_pb2.RequestTimings, _Mapping]] = ...) -> None: ...

class PrefillServerMessage(_message.Message):
    __slots__ = ("first_token", "transfer_complete", "progress")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_complete: TransferComplete
    progress: PrefillProgress
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_complete: _Optional[_Union[TransferComplete, _Mapping]] = ..., progress: _Optional[_Union[PrefillProgress, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "prefill_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParameters
    prefill_address: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParameters, _Mapping]] = ..., prefill_address: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "usage", "timings", "prompt_logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.RequestTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.RequestTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "snapshot", "stored", "removed", "block_size")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "incarnation_id", "total_kv_blocks", "free_kv_blocks", "num_running", "num_waiting", "num_waiting_for_kv", "queued_prompt_tokens", "busy_fraction", "prefix_cache_hit_tokens", "held_kv_blocks", "kv_layout", "max_num_seqs", "max_queued_requests", "cpu_kernel_routes", "core_group")
    class CpuKernelRoutesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNEL_ROUTES_FIELD_NUMBER: _ClassVar[int]
    CORE_GROUP_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    incarnation_id: str
    total_kv_blocks: int
    free_kv_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    queued_prompt_tokens: int
    busy_fraction: float
    prefix_cache_hit_tokens: int
    held_kv_blocks: int
    kv_layout: _kv_pb2.KVLayout
    max_num_seqs: int
    max_queued_requests: int
    cpu_kernel_routes: _containers.ScalarMap[str, str]
    core_group: str
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., incarnation_id: _Optional[str] = ..., total_kv_blocks: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., held_kv_blocks: _Optional[int] = ..., kv_layout: _Optional[_Union[_kv_pb2.KVLayout, _Mapping]] = ..., max_num_seqs: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., cpu_kernel_routes: _Optional[_Mapping[str, str]] = ..., core_group: _Optional[str] = ...) -> None: ...
