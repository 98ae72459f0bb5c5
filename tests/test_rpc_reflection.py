"""rpc.reflection: every RpcServer answers reflection v1 beside v1alpha (v1alpha:
tests/test_rpc_server.py).

v1 is checked twice: with a raw v1 call from Python, and with ``buf curl
--reflect-protocol grpc-v1``, a real third-party client that uses v1 only, listing the
methods and then calling one by name.
"""

from __future__ import annotations

import asyncio
import json

import grpc.aio
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from rpc import reflection
from tests.test_protos_buf import buf_binary
from tests.test_rpc_server import CALL_TIMEOUT, DECODE, PREFILL, running

HEALTH = "grpc.health.v1.Health"


async def v1_exchange(channel: grpc.aio.Channel, **requests: str) -> list:
    """One v1 reflection stream: each keyword is a request field; returns the replies."""
    request_class, response_class = reflection.v1_message_classes()
    call = channel.stream_stream(
        reflection.v1_method_path(),
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )(timeout=CALL_TIMEOUT)
    replies = []
    for field, value in requests.items():
        await call.write(request_class(**{field: value}))
        replies.append(await call.read())
    await call.done_writing()
    return replies


def test_v1_descriptor_is_v1alpha_renamed() -> None:
    file = reflection.v1_file_descriptor()
    assert (file.name, file.package) == (
        "grpc/reflection/v1/reflection.proto",
        "grpc.reflection.v1",
    )
    v1 = file.message_types_by_name
    old = v1alpha_pb2.DESCRIPTOR.message_types_by_name
    assert set(v1) == set(old)
    for name, message in v1.items():
        fields = [(f.name, f.number, f.type, f.is_repeated) for f in message.fields]
        assert fields == [(f.name, f.number, f.type, f.is_repeated) for f in old[name].fields], name
        for field in message.fields:
            if field.message_type is not None:
                assert field.message_type.full_name.startswith("grpc.reflection.v1."), field
    method = file.services_by_name["ServerReflection"].methods_by_name["ServerReflectionInfo"]
    assert method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    assert not file.GetOptions().deprecated


async def test_v1_lists_and_describes_services() -> None:
    async with running() as (_, channel, _, _):
        listed, baton_file, v1_file = await v1_exchange(
            channel,
            list_services="",
            file_containing_symbol=DECODE,
            file_by_filename="grpc/reflection/v1/reflection.proto",
        )
    names = {s.name for s in listed.list_services_response.service}
    assert {DECODE, PREFILL, HEALTH, *reflection.SERVICE_NAMES} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in baton_file.file_descriptor_response.file_descriptor_proto
    ]
    # Named from the proto root, with their imports, as a code generator expects them.
    assert {f.name for f in files} == {
        "baton/v1/worker.proto",
        "baton/v1/common.proto",
        "baton/v1/kv.proto",
    }
    worker = next(f for f in files if f.name == "baton/v1/worker.proto")
    assert {s.name for s in worker.service} == {"DecodeWorker", "PrefillWorker"}
    (raw,) = v1_file.file_descriptor_response.file_descriptor_proto
    assert descriptor_pb2.FileDescriptorProto.FromString(raw).package == "grpc.reflection.v1"


async def buf_curl(port: int, *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        buf_binary(),
        "curl",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
        "--reflect-protocol",
        "grpc-v1",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, f"buf curl {' '.join(args)}: {err.decode()}"
    return out.decode()


async def test_buf_curl_with_v1_reflection_lists_and_calls() -> None:
    async with running() as (server, _, _, _):
        await server.wait_ready()
        url = f"http://127.0.0.1:{server.port}"
        methods = (await buf_curl(server.port, "--list-methods", url)).split()
        stats = json.loads(await buf_curl(server.port, f"{url}/{DECODE}/Stats"))
    assert f"{DECODE}/Decode" in methods and f"{PREFILL}/Prefill" in methods
    assert f"{reflection.V1_SERVICE_NAME}/ServerReflectionInfo" in methods
    assert stats["incarnationId"] == "toy" and stats["role"] == "WORKER_ROLE_DECODE"
