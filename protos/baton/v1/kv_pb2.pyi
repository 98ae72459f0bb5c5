from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KVTransport]
    KV_TRANSPORT_SHM: _ClassVar[KVTransport]
    KV_TRANSPORT_GLOO: _ClassVar[KVTransport]
    KV_TRANSPORT_CUDA_IPC: _ClassVar[KVTransport]
    KV_TRANSPORT_NCCL: _ClassVar[KVTransport]
    KV_TRANSPORT_NIXL: _ClassVar[KVTransport]

class KVDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KVDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KVDtype]
KV_TRANSPORT_UNSPECIFIED: KVTransport
KV_TRANSPORT_SHM: KVTransport
KV_TRANSPORT_GLOO: KVTransport
KV_TRANSPORT_CUDA_IPC: KVTransport
KV_TRANSPORT_NCCL: KVTransport
KV_TRANSPORT_NIXL: KVTransport
KV_DTYPE_UNSPECIFIED: KVDtype
KV_DTYPE_FLOAT32: KVDtype
KV_DTYPE_BFLOAT16: KVDtype
KV_DTYPE_FLOAT16: KVDtype

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "deterministic")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype
    deterministic: bool
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[KVDtype, str]] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class KVDescriptor(_message.Message):
    __slots__ = ("transport", "endpoint", "block_ids", "layout", "incarnation_id", "block_epoch", "request_id", "num_blocks", "lease_token", "handle", "first_block")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    transport: KVTransport
    endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: KVLayout
    incarnation_id: str
    block_epoch: int
    request_id: str
    num_blocks: int
    lease_token: int
    handle: bytes
    first_block: int
    def __init__(self, transport: _Optional[_Union[KVTransport, str]] = ..., endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., incarnation_id: _Optional[str] = ..., block_epoch: _Optional[int] = ..., request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., lease_token: _Optional[int] = ..., handle: _Optional[bytes] = ..., first_block: _Optional[int] = ...) -> None: ...
