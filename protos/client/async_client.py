"""The asyncio client: :class:`AsyncClient` and the :class:`AsyncStream` of one completion.

    async with AsyncClient("127.0.0.1:50051") as client:
        async with client.generate(text="Once upon a time") as stream:
            async for chunk in stream:
                print(chunk.text, end="", flush=True)

Create the client inside a coroutine: its channel belongs to the running event loop.
Leaving the stream's ``async with`` block, calling :meth:`AsyncStream.cancel`, or
cancelling the task that reads the stream cancels the request on the server. Every
failure raises a typed :class:`~protos.client.errors.BatonError`; a cancelled *task*
still raises ``asyncio.CancelledError``, as asyncio code expects.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import grpc
import grpc.aio

from protos.baton.v1 import generate_pb2, generate_pb2_grpc
from protos.client.channel import DEFAULT_TIMEOUT, Timeout, aio_channel, resolve_timeout
from protos.client.errors import CancelledError, error_from_rpc
from protos.client.messages import (
    ChatTurn,
    Chunk,
    Completion,
    ModelInfo,
    SamplingParams,
    generate_request,
)
from protos.client.tools import Tool, ToolChoiceSpec


class AsyncStream(AsyncIterator[Chunk]):
    """One streaming Generate call. ``async for`` it; ``cancel()`` to stop it early."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._cancelled_by_us = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        try:
            response = await self._call.read()
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
        except asyncio.CancelledError as err:
            if self._cancelled_by_us:
                # grpc.aio reports a locally cancelled call as asyncio.CancelledError; this
                # one was ours, not the task's, so it is the typed CANCELLED.
                raise CancelledError(grpc.StatusCode.CANCELLED, "cancelled by the client") from err
            self._call.cancel()  # the reading task was cancelled: so is the request
            raise
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return Chunk.from_proto(response)

    def cancel(self) -> None:
        """Cancel the request (no-op once finished). A read in progress raises CancelledError."""
        if not self._call.done():
            self._cancelled_by_us = True
            self._call.cancel()

    async def completion(self) -> Completion:
        """Read the rest of the stream and join it."""
        return Completion.from_chunks([chunk async for chunk in self])

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class AsyncClient:
    """An asyncio client of one baton gateway (see :class:`protos.client.Client` for the
    arguments). Close it with ``await client.close()`` or ``async with``."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.metadata = tuple(metadata)
        self._channel = aio_channel(address, credentials, options)
        self._stub = generate_pb2_grpc.BatonStub(self._channel)

    async def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def model_info(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> ModelInfo:
        """Describe the served model."""
        try:
            reply = await self._stub.ModelInfo(
                generate_pb2.ModelInfoRequest(),
                timeout=resolve_timeout(timeout, self.timeout),
                metadata=self.metadata,
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
        return ModelInfo.from_proto(reply)

    def generate(
        self,
        *,
        text: str | None = None,
        chat: Sequence[ChatTurn] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool | None = None,
        skip_special_tokens: bool | None = None,
        request_id: str | None = None,
        tools: Sequence[Tool] | None = None,
        tool_choice: ToolChoiceSpec | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> AsyncStream:
        """Start one completion and return its :class:`AsyncStream` (not a coroutine:
        ``async for chunk in client.generate(...)`` works). Give exactly one of ``text``,
        ``chat`` or ``token_ids``; errors surface while iterating."""
        request = generate_request(
            text=text,
            chat=chat,
            token_ids=token_ids,
            sampling=sampling,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            skip_special_tokens=skip_special_tokens,
            request_id=request_id,
            tools=tools,
            tool_choice=tool_choice,
        )
        call = self._stub.Generate(
            request, timeout=resolve_timeout(timeout, self.timeout), metadata=self.metadata
        )
        return AsyncStream(call)

    async def complete(
        self,
        *,
        text: str | None = None,
        chat: Sequence[ChatTurn] | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool | None = None,
        skip_special_tokens: bool | None = None,
        request_id: str | None = None,
        tools: Sequence[Tool] | None = None,
        tool_choice: ToolChoiceSpec | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> Completion:
        """:meth:`generate`, read to its end and joined into one :class:`Completion`."""
        async with self.generate(
            text=text,
            chat=chat,
            token_ids=token_ids,
            sampling=sampling,
            stop=stop,
            include_stop_str_in_output=include_stop_str_in_output,
            skip_special_tokens=skip_special_tokens,
            request_id=request_id,
            tools=tools,
            tool_choice=tool_choice,
            timeout=timeout,
        ) as stream:
            return await stream.completion()
