"""An in-process fake gateway (``baton.v1.Baton``) for client tests.

It streams ``texts`` one chunk each (token ids 1, 2, ...; finish reason and usage on the
last), optionally slowly, optionally failing with a chosen status after some chunks, or
hanging until cancelled; and it records what each call brought (request, metadata,
deadline) and which calls were cancelled. It runs behind a real ``RpcServer`` on
127.0.0.1 port 0, so statuses reach the client as they would from the real gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from rpc.server import RpcServer, ServerSpec

BATON_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Baton"].full_name
MODEL_INFO = generate_pb2.ModelInfoResponse(
    model_id="fake-model",
    vocab_size=100,
    max_model_len=64,
    eos_token_ids=[2],
    has_chat_template=True,
    max_logprobs=5,
)


@dataclass(slots=True)
class FakeGateway(generate_pb2_grpc.BatonServicer):
    texts: Sequence[str] = ("Hel", "lo", "!")
    delay_s: float = 0.0  # before each chunk
    abort: tuple[grpc.StatusCode, str] | None = None  # ends the call after `fail_after` chunks
    fail_after: int = 0
    hang: bool = False  # after the chunks: wait until cancelled instead of finishing
    refuse_text: str | None = None  # this prompt text gets INVALID_ARGUMENT naming a field
    requests: list[generate_pb2.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    time_remaining: list[float | None] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def ModelInfo(self, request, context):  # noqa: N802 (gRPC method name)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.abort is not None:
            await context.abort(*self.abort)
        return MODEL_INFO

    async def Generate(self, request, context):  # noqa: N802
        rid = request.request_id or f"fake-{len(self.requests)}"
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.time_remaining.append(context.time_remaining())
        self.started.set()
        if self.refuse_text is not None and request.text == self.refuse_text:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.max_tokens must be >= 1"
            )
        ended = False  # by itself: finished or aborted, not cancelled
        try:
            for i, text in enumerate(self.texts):
                if self.abort is not None and i == self.fail_after:
                    ended = True
                    await context.abort(*self.abort)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(self.texts) - 1 and not self.hang
                yield self._chunk(rid, i, text, last, request)
            if self.hang:
                await asyncio.Event().wait()
            ended = True
        finally:
            # A cancel lands as CancelledError where the handler awaits, or as
            # GeneratorExit (aclose) where it is suspended at a yield: both count.
            if not ended:
                self.cancelled.append(rid)

    def _chunk(
        self, rid: str, i: int, text: str, last: bool, request: generate_pb2.GenerateRequest
    ) -> generate_pb2.GenerateResponse:
        msg = generate_pb2.GenerateResponse(request_id=rid, token_ids=[i + 1], text=text)
        if request.sampling_params.HasField("logprobs"):
            msg.logprobs.add(token_id=i + 1, logprob=-0.25, rank=1).top.add(
                token_id=i + 1, logprob=-0.25
            )
        if last:
            msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
            msg.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=len(request.token_ids.ids) or 4,
                    completion_tokens=len(self.texts),
                    cached_tokens=1,
                )
            )
        return msg


@contextlib.asynccontextmanager
async def fake_gateway(
    gateway: FakeGateway | None = None,
) -> AsyncIterator[tuple[FakeGateway, str]]:
    """Serve ``gateway`` (a new one by default); yields it and its address."""
    gateway = gateway or FakeGateway()
    spec = ServerSpec(
        name="fake-gateway",
        register=lambda server: generate_pb2_grpc.add_BatonServicer_to_server(gateway, server),
        service_names=(BATON_SERVICE,),
        grace_s=0.0,
    )
    server = RpcServer(spec)
    await server.start()
    try:
        await server.wait_ready()
        yield gateway, f"127.0.0.1:{server.port}"
    finally:
        await server.stop()
