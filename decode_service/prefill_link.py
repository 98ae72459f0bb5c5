"""A ``PrefillLink`` over gRPC: decode's end of one ``PrefillWorker.Prefill`` stream.

Wiring only: records go through ``rpc.convert_handoff``; a failed call surfaces as its
typed error, also when it is a write that finds the call already ended (the prefill
worker died between two messages); a message that breaks the protocol as ABORTED.
RESOURCE_EXHAUSTED (the prefill worker's queue is full) surfaces as a
``RoleExhaustedError`` naming the prefill role, which this decode worker's interceptor
relays to the gateway in the trailing metadata, so the gateway retries on another
prefill worker rather than taking this decode worker for full. The call's metadata
carries the trace context (``traceparent``) to the prefill worker.
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from opentelemetry.context import Context

from engine.errors import AbortedError
from engine.transfer.handoff import Ack, PrefillEvent, PrefillOrder
from protos.baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.convert_handoff import ack_to_proto, prefill_event_from_proto, prefill_order_to_proto
from rpc.errors import typed_rpc_errors
from rpc.tracing import metadata_for

# Whatever capacity this call finds exhausted is the prefill worker's.
_ROLE = worker_pb2.WORKER_ROLE_PREFILL


class GrpcPrefillLink:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        timeout: float | None,
        trace_context: Context | None = None,
    ) -> None:
        self._address = address
        self._rid = ""
        metadata = metadata_for(trace_context) or None
        self._call = worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
            timeout=timeout, metadata=metadata
        )

    async def send(self, message: PrefillOrder | Ack) -> None:
        if isinstance(message, PrefillOrder):
            self._rid = message.request_id
            proto = prefill_order_to_proto(message)
        else:
            proto = ack_to_proto(self._rid, message)
        with typed_rpc_errors(f"prefill {self._address}", role=_ROLE):
            try:
                await self._call.write(proto)
            except asyncio.InvalidStateError:
                # The call ended before this write (its peer failed or left): grpc says
                # "RPC already finished"; the call's own status says how, as a read would.
                await self._raise_ended()

    async def _raise_ended(self) -> None:
        code = await self._call.code()
        if code is grpc.StatusCode.OK:
            raise AbortedError(
                f"request {self._rid}: prefill {self._address} ended the stream while"
                " decode still had a message for it"
            )
        raise grpc.aio.AioRpcError(
            code,
            await self._call.initial_metadata(),
            await self._call.trailing_metadata(),
            await self._call.details(),
        )

    async def receive(self) -> PrefillEvent | None:
        with typed_rpc_errors(f"prefill {self._address}", role=_ROLE):
            msg = await self._call.read()
        if msg is grpc.aio.EOF:
            return None
        try:
            return prefill_event_from_proto(msg)
        except ValueError as exc:
            raise AbortedError(
                f"request {self._rid}: prefill {self._address} broke the protocol: {exc}"
            ) from exc

    async def done_writing(self) -> None:
        with typed_rpc_errors(f"prefill {self._address}", role=_ROLE):
            await self._call.done_writing()

    def cancel(self) -> None:
        if not self._call.done():
            self._call.cancel()
