"""The blocking client: :class:`Client` and the :class:`Stream` of one completion.

    with Client("127.0.0.1:50051") as client:
        with client.generate(text="Once upon a time", sampling=SamplingParams(max_tokens=32)) as s:
            for chunk in s:
                print(chunk.text, end="", flush=True)

A :class:`Stream` is an iterator of :class:`~protos.client.messages.Chunk`. Leaving its
``with`` block, or calling :meth:`Stream.cancel` (from any thread), cancels the request
on the server, which frees everything it held. Every failure raises a typed
:class:`~protos.client.errors.BatonError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import TracebackType

import grpc

from protos.baton.v1 import generate_pb2, generate_pb2_grpc
from protos.client.channel import DEFAULT_TIMEOUT, Timeout, resolve_timeout, sync_channel
from protos.client.errors import error_from_rpc
from protos.client.messages import (
    ChatTurn,
    Chunk,
    Completion,
    ModelInfo,
    SamplingParams,
    generate_request,
)
from protos.client.tools import Tool, ToolChoiceSpec


class Stream(Iterator[Chunk]):
    """One streaming Generate call. Iterate it for chunks; ``cancel()`` to stop it early."""

    def __init__(self, call: grpc.Call) -> None:
        self._call = call

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        try:
            return Chunk.from_proto(next(self._call))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err

    def cancel(self) -> None:
        """Cancel the request (no-op once finished). An iteration in progress, here or in
        another thread, raises CancelledError."""
        self._call.cancel()

    def completion(self) -> Completion:
        """Read the rest of the stream and join it."""
        return Completion.from_chunks(self)

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()


class Client:
    """A blocking client of one baton gateway. Thread-safe; close it (or use ``with``).

    ``timeout`` is the default deadline of each call in seconds (None: no deadline); every
    method takes its own ``timeout`` too. ``credentials`` makes the channel TLS;
    ``metadata`` is sent with every call (e.g. ``[("authorization", "Bearer ...")]``);
    ``options`` adds or overrides gRPC channel options.
    """

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
        self._channel = sync_channel(address, credentials, options)
        self._stub = generate_pb2_grpc.BatonStub(self._channel)

    def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def model_info(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> ModelInfo:
        """Describe the served model."""
        try:
            reply = self._stub.ModelInfo(
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
    ) -> Stream:
        """Start one completion and return its :class:`Stream`. Give exactly one of
        ``text`` (plain prompt), ``chat`` (turns, rendered by the model's chat template)
        or ``token_ids``. The call starts at once; errors surface while iterating."""
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
        return Stream(call)

    def complete(
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
        with self.generate(
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
            return stream.completion()
