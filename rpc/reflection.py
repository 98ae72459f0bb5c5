"""Server reflection in both versions: ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

Reflection lets grpcurl, ``buf curl``, Postman and friends list and call baton's services
without the .proto files. Recent tools ask for v1 first and fall back to v1alpha only on
UNIMPLEMENTED; some never fall back.

grpcio-reflection (1.85, the newest) ships a v1alpha service only. v1 is the same
protocol: grpc's ``reflection/v1/reflection.proto`` is v1alpha's under a new package name,
with the same messages, fields and numbers. So one v1alpha servicer answers both: v1 is
registered as a generic handler under ``/grpc.reflection.v1.ServerReflection/`` whose
(de)serializers are v1alpha's message classes, which read and write v1's bytes unchanged.
:func:`v1_file_descriptor` derives v1's file descriptor from v1alpha's by renaming the
package, and adds it to the default pool, so reflection describes the v1 service too
(``buf curl --list-methods`` asks for it).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import grpc
import grpc.aio
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_METHOD = "ServerReflectionInfo"


@cache
def v1_file_descriptor() -> descriptor.FileDescriptor:
    """``grpc/reflection/v1/reflection.proto``, in the default pool (added on first call).

    Built from v1alpha's descriptor: package renamed, type references pointed at it, and
    the file options of grpc's own v1 file (no ``deprecated``, v1's Go and Java packages).
    """
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(_V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old_prefix, new_prefix = f".{v1alpha_pb2.DESCRIPTOR.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old_prefix):
                field.type_name = new_prefix + field.type_name[len(old_prefix) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new_prefix + method.input_type[len(old_prefix) :]
            method.output_type = new_prefix + method.output_type[len(old_prefix) :]
    proto.options.Clear()
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.java_multiple_files = True
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.java_outer_classname = "ServerReflectionProto"
    pool.AddSerializedFile(proto.SerializeToString())
    return pool.FindFileByName(_V1_FILE)


def v1_message_classes() -> tuple[type, type]:
    """(ServerReflectionRequest, ServerReflectionResponse) of v1, for v1 clients."""
    file = v1_file_descriptor()
    return (
        message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionRequest"]),
        message_factory.GetMessageClass(file.message_types_by_name["ServerReflectionResponse"]),
    )


def v1_method_path() -> str:
    """``/grpc.reflection.v1.ServerReflection/ServerReflectionInfo``."""
    return f"/{V1_SERVICE_NAME}/{_METHOD}"


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both
    reflection services. Call before the server starts."""
    v1_file_descriptor()
    servicer = reflection.aio.ReflectionServicer((*service_names, *SERVICE_NAMES))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    generic = (
        grpc.method_handlers_generic_handler(V1ALPHA_SERVICE_NAME, {_METHOD: handler}),
        grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {_METHOD: handler}),
    )
    server.add_generic_rpc_handlers(generic)
