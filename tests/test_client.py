"""protos.client against an in-process fake gateway: streaming, requests on the wire, typed
errors, deadlines, cancellation, metadata, TLS, and the command line.

The blocking :class:`Client` runs in a worker thread (``asyncio.to_thread``): the fake
gateway serves from this test's event loop.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import grpc.aio
import pytest

from protos.baton.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from protos.client import (
    AsyncClient,
    Chunk,
    Client,
    Completion,
    FinishReason,
    SamplingParams,
    Usage,
)
from protos.client import errors as client_errors
from protos.client.cli import main as cli_main
from protos.client.messages import generate_request
from tests.certs import CertAuthority
from tests.fake_gateway import FakeGateway, fake_gateway

USAGE = Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=1)


# --- requests as they reach the wire -------------------------------------------------


def test_sampling_params_send_only_what_is_set() -> None:
    msg = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(5, 6)).to_proto()
    assert msg.max_tokens == 8 and msg.HasField("temperature") and msg.temperature == 0.0
    assert list(msg.stop_token_ids) == [5, 6]
    assert not msg.HasField("top_p") and not msg.HasField("seed")


def test_generate_request_carries_each_prompt_form_and_option() -> None:
    chat = generate_request(
        chat=[("system", "Be brief."), {"role": "user", "content": "Hi"}],
        stop=["\n"],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        request_id="r-1",
    )
    assert chat.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in chat.chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    assert list(chat.stop) == ["\n"] and chat.request_id == "r-1"
    assert chat.include_stop_str_in_output is True and chat.skip_special_tokens is False
    ids = generate_request(token_ids=[])
    assert ids.WhichOneof("prompt") == "token_ids"  # empty, but the form is still sent
    text = generate_request(text="x")
    assert not text.HasField("sampling_params") and not text.HasField("skip_special_tokens")


@pytest.mark.parametrize(
    "kwargs", [{}, {"text": "a", "token_ids": [1]}, {"text": "a", "chat": []}], ids=str
)
def test_exactly_one_prompt_form(kwargs: dict) -> None:
    with pytest.raises(TypeError, match="exactly one of text, chat or token_ids"):
        generate_request(**kwargs)


def test_one_string_is_not_a_list_of_stop_strings() -> None:
    with pytest.raises(TypeError, match="stop"):
        generate_request(text="a", stop="\n")


# --- streaming -------------------------------------------------------------------------


def _sync_stream(address: str, **kwargs: object) -> list[Chunk]:
    with Client(address, timeout=10) as client:
        with client.generate(**kwargs) as stream:
            return list(stream)


async def test_sync_client_streams_text_and_token_ids() -> None:
    async with fake_gateway() as (gateway, address):
        chunks = await asyncio.to_thread(
            _sync_stream,
            address,
            token_ids=[7, 8, 9],
            sampling=SamplingParams(max_tokens=3, logprobs=1),
            request_id="sync-1",
        )
    assert [c.text for c in chunks] == ["Hel", "lo", "!"]
    assert [c.token_ids for c in chunks] == [(1,), (2,), (3,)]
    assert [c.finish_reason for c in chunks] == [None, None, FinishReason.LENGTH]
    assert chunks[-1].usage == USAGE and chunks[0].usage is None
    assert chunks[1].logprobs[0].top == ((2, -0.25),)
    assert {c.request_id for c in chunks} == {"sync-1"}
    (request,) = gateway.requests
    assert list(request.token_ids.ids) == [7, 8, 9] and request.sampling_params.max_tokens == 3


async def test_async_client_streams_and_completes() -> None:
    async with fake_gateway() as (gateway, address), AsyncClient(address) as client:
        chunks = [c async for c in client.generate(text="hi")]
        completion = await client.complete(chat=[("user", "hi")], request_id="a-2")
        info = await client.model_info()
    assert "".join(c.text for c in chunks) == "Hello!"
    assert completion == Completion(
        request_id="a-2",
        text="Hello!",
        token_ids=(1, 2, 3),
        logprobs=(),
        finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=1),
    )
    assert gateway.requests[0].text == "hi"
    assert gateway.requests[1].chat.messages[0].content == "hi"
    assert info.model_id == "fake-model" and info.eos_token_ids == (2,)


async def test_sync_complete_and_model_info() -> None:
    def run(address: str) -> tuple[Completion, str]:
        with Client(address) as client:
            return client.complete(text="x"), client.model_info().model_id

    async with fake_gateway() as (_, address):
        completion, model_id = await asyncio.to_thread(run, address)
    assert completion.text == "Hello!" and completion.usage.completion_tokens == 3
    assert model_id == "fake-model"


async def test_metadata_is_sent_with_every_call() -> None:
    headers = [("authorization", "Bearer k"), ("x-tenant", "t1")]
    async with fake_gateway() as (gateway, address):
        async with AsyncClient(address, metadata=headers) as client:
            await client.complete(text="x")
            await client.model_info()
        await asyncio.to_thread(lambda: Client(address, metadata=headers).complete(text="y"))
    for seen in gateway.metadata:
        assert seen["authorization"] == "Bearer k" and seen["x-tenant"] == "t1"
    assert len(gateway.metadata) == 3


async def test_credentials_make_a_tls_channel(tmp_path: Path) -> None:
    # Certificates made in this process (tests/certs.py): no openssl command on the host.
    server_id = CertAuthority(tmp_path).issue("server")
    key, cert = server_id.key.read_bytes(), server_id.cert.read_bytes()
    gateway = FakeGateway()
    server = grpc.aio.server()
    generate_pb2_grpc.add_BatonServicer_to_server(gateway, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    await server.start()
    try:
        address = f"localhost:{port}"
        creds = grpc.ssl_channel_credentials(root_certificates=server_id.ca.read_bytes())
        async with AsyncClient(address, credentials=creds) as client:
            assert (await client.complete(text="x")).text == "Hello!"
        text = await asyncio.to_thread(
            lambda: Client(address, credentials=creds).complete(text="x").text
        )
        assert text == "Hello!"
        async with AsyncClient(address, timeout=5) as plain:  # plaintext to a TLS port
            with pytest.raises(client_errors.UnavailableError):
                await plain.complete(text="x")
    finally:
        await server.stop(0)


# --- typed errors ------------------------------------------------------------------------

FAMILIES = [
    (grpc.StatusCode.INVALID_ARGUMENT, client_errors.InvalidRequestError),
    (grpc.StatusCode.OUT_OF_RANGE, client_errors.InvalidRequestError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, client_errors.ResourceExhaustedError),
    (grpc.StatusCode.UNAVAILABLE, client_errors.UnavailableError),
    (grpc.StatusCode.ABORTED, client_errors.AbortedError),
    (grpc.StatusCode.DEADLINE_EXCEEDED, client_errors.DeadlineExceededError),
    (grpc.StatusCode.CANCELLED, client_errors.CancelledError),
    (grpc.StatusCode.UNAUTHENTICATED, client_errors.AuthError),
    (grpc.StatusCode.PERMISSION_DENIED, client_errors.AuthError),
    (grpc.StatusCode.UNIMPLEMENTED, client_errors.UnsupportedError),
    (grpc.StatusCode.NOT_FOUND, client_errors.UnsupportedError),
    (grpc.StatusCode.INTERNAL, client_errors.ServerError),
    (grpc.StatusCode.FAILED_PRECONDITION, client_errors.ServerError),
    (grpc.StatusCode.DATA_LOSS, client_errors.ServerError),
    (grpc.StatusCode.UNKNOWN, client_errors.ServerError),
]


@pytest.mark.parametrize(("code", "kind"), FAMILIES, ids=[c.name for c, _ in FAMILIES])
async def test_each_status_raises_its_family(code: grpc.StatusCode, kind: type) -> None:
    message = f"sampling_params.top_p: {code.name.lower()}"
    gateway = FakeGateway(abort=(code, message), fail_after=1)
    async with fake_gateway(gateway) as (_, address), AsyncClient(address) as client:
        got: list[Chunk] = []
        with pytest.raises(kind) as info:
            async for chunk in client.generate(text="x"):
                got.append(chunk)
    assert len(got) == 1  # what came before the failure was delivered
    assert info.value.code is code and info.value.message == message
    assert isinstance(info.value, client_errors.BatonError)
    assert isinstance(info.value.__cause__, grpc.RpcError)


async def test_sync_errors_are_typed_too() -> None:
    gateway = FakeGateway(abort=(grpc.StatusCode.INVALID_ARGUMENT, "temperature: -1"))

    def run(address: str) -> None:
        with Client(address) as client:
            with pytest.raises(client_errors.InvalidRequestError, match="temperature: -1"):
                client.complete(text="x")
            with pytest.raises(ValueError):  # InvalidRequestError is a ValueError
                client.model_info()

    async with fake_gateway(gateway) as (_, address):
        await asyncio.to_thread(run, address)


def test_unreachable_gateway_is_unavailable() -> None:
    with Client("127.0.0.1:1", timeout=5) as client:
        with pytest.raises(client_errors.UnavailableError) as info:
            client.complete(text="x")
    assert info.value.retryable


# --- deadlines ---------------------------------------------------------------------------


_DEADLINE_SLACK = 0.05


async def test_deadline_reaches_the_server_and_expires() -> None:
    gateway = FakeGateway(delay_s=0.5)
    async with fake_gateway(gateway) as (_, address):
        async with AsyncClient(address, timeout=30) as client:
            with pytest.raises(client_errors.DeadlineExceededError):
                await client.complete(text="x", timeout=0.3)
            await client.complete(text="x", timeout=None)  # None: no deadline at all
        with pytest.raises(TimeoutError):  # DeadlineExceededError is a TimeoutError
            await asyncio.to_thread(Client(address, timeout=0.3).complete, text="x")
    first, unbounded, sync = gateway.time_remaining
    # gRPC encodes the timeout rounded up to its unit and the server adds its own clock
    # reading, so what it sees may exceed 0.3 s by microseconds (CI saw 0.30002); the
    # point is that the call's own 0.3 s arrived, not the client's default 30 s.
    assert first is not None and 0 < first <= _DEADLINE_SLACK + 0.3
    assert unbounded is None
    assert sync is not None and 0 < sync <= _DEADLINE_SLACK + 0.3
    await _eventually(lambda: len(gateway.cancelled) == 2)  # both timed-out calls


# --- cancellation ------------------------------------------------------------------------


async def _eventually(check, timeout: float = 5.0) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def test_leaving_an_async_stream_block_cancels_on_the_server() -> None:
    gateway = FakeGateway(hang=True)
    async with fake_gateway(gateway) as (_, address), AsyncClient(address) as client:
        async with client.generate(text="x", request_id="leave") as stream:
            async for _ in stream:
                break
        await _eventually(lambda: gateway.cancelled == ["leave"])  # channel still open


async def test_async_cancel_during_a_read_raises_typed_cancelled() -> None:
    gateway = FakeGateway(hang=True)
    async with fake_gateway(gateway) as (_, address), AsyncClient(address) as client:
        stream = client.generate(text="x", request_id="cancel")
        got = [await anext(stream) for _ in range(3)]
        reading = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        stream.cancel()
        with pytest.raises(client_errors.CancelledError, match="cancelled by the client"):
            await reading
        await _eventually(lambda: gateway.cancelled == ["cancel"])
    assert len(got) == 3


async def test_cancelling_the_reading_task_cancels_the_request() -> None:
    gateway = FakeGateway(hang=True)
    async with fake_gateway(gateway) as (_, address), AsyncClient(address) as client:

        async def consume() -> None:
            async for _ in client.generate(text="x", request_id="task"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.wait_for(gateway.started.wait(), 5)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):  # the task's own cancellation
            await task
        await _eventually(lambda: gateway.cancelled == ["task"])


async def test_sync_cancel_from_another_thread_and_leaving_the_block() -> None:
    gateway = FakeGateway(hang=True)

    def run(address: str) -> tuple[int, type[BaseException] | None]:
        with Client(address) as client:
            with client.generate(text="x", request_id="left") as stream:
                next(stream)  # leave the block after one chunk
            stream = client.generate(text="x", request_id="thread")
            got, raised = 0, None
            threading.Timer(0.3, stream.cancel).start()
            try:
                for _ in stream:
                    got += 1
            except client_errors.CancelledError as err:
                raised = type(err)
            return got, raised

    async with fake_gateway(gateway) as (_, address):
        got, raised = await asyncio.to_thread(run, address)
        await _eventually(lambda: sorted(gateway.cancelled) == ["left", "thread"])
    assert got == 3 and raised is client_errors.CancelledError


# --- the command line --------------------------------------------------------------------


async def test_cli_streams_to_stdout_and_reports_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with fake_gateway() as (gateway, address):
        argv = ["--address", address, "--chat", "--system", "S", "--max-tokens", "3", "hi"]
        assert await asyncio.to_thread(cli_main, argv) == 0
        gateway.abort = (grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.max_tokens: 0")
        assert await asyncio.to_thread(cli_main, ["--address", address, "x"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("Hello!")
    assert "[length; prompt 4 tokens, completion 3, cached 1" in err
    assert "error: InvalidRequestError: INVALID_ARGUMENT: sampling_params.max_tokens: 0" in err
    request = gateway.requests[0]
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "S"), ("user", "hi")]
    assert request.sampling_params.max_tokens == 3


def test_the_last_chunk_and_the_completion_carry_the_timings() -> None:
    last = generate_pb2.GenerateResponse(
        request_id="r",
        token_ids=[5],
        text="x",
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=2),
        timings=common_pb2.RequestTimings(queued_s=0.0, first_token_s=0.25, total_s=1.5),
    )
    middle = Chunk.from_proto(generate_pb2.GenerateResponse(request_id="r", token_ids=[4]))
    chunk = Chunk.from_proto(last)
    assert middle.timings is None
    assert chunk.timings == {"queued_s": 0.0, "first_token_s": 0.25, "total_s": 1.5}
    assert Completion.from_chunks([middle, chunk]).timings == chunk.timings
