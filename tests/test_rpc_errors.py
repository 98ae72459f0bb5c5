"""rpc.errors without a server: the exception <-> status tables and the client helper."""

from __future__ import annotations

import grpc
import pytest

from engine import errors
from protos.baton.v1 import worker_pb2
from rpc.errors import (
    EXHAUSTED_ROLE_KEY,
    PeerRpcError,
    RoleExhaustedError,
    abort_with,
    error_from_rpc,
    error_from_status,
    status_for,
    typed_rpc_errors,
)

TYPED = [
    (ValueError("bad top_p"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.LayoutMismatchError("block_size: 16 != 32"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhaustedError("no free KV blocks"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnavailableError("prefill is gone"), grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError("transfer took too long"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (TimeoutError("wait_for timed out"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.CancelledError("stop string hit"), grpc.StatusCode.CANCELLED),
    (errors.AbortedError("checksum mismatch"), grpc.StatusCode.ABORTED),
    (NotImplementedError("no beam search"), grpc.StatusCode.UNIMPLEMENTED),
]


class FakeRpcError(grpc.RpcError):
    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


class FakeContext:
    """Records the one ``abort`` a handler's failure makes."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None = None

    async def abort(
        self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()
    ) -> None:
        self.aborted = (code, details, tuple(trailing_metadata))


@pytest.mark.parametrize(("exc", "code"), TYPED, ids=[type(e).__name__ for e, _ in TYPED])
def test_typed_errors_get_their_code_and_message(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_for(exc) == (code, str(exc))


def test_unexpected_errors_are_internal() -> None:
    code, message = status_for(KeyError("slot"))
    assert code is grpc.StatusCode.INTERNAL
    assert "KeyError" in message


@pytest.mark.parametrize(
    ("exc", "code"),
    [(e, c) for e, c in TYPED if type(e) not in (TimeoutError, NotImplementedError)],
    ids=lambda v: getattr(v, "name", type(v).__name__),
)
def test_client_side_mapping_inverts_the_server_side(exc: Exception, code: grpc.StatusCode) -> None:
    back = error_from_status(code, str(exc))
    assert type(back) is type(exc)
    assert status_for(back) == (code, str(exc))


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED]
)
def test_peer_faults_become_internal_here(code: grpc.StatusCode) -> None:
    err = error_from_status(code, "boom")
    assert isinstance(err, PeerRpcError) and err.code is code
    assert status_for(err)[0] is grpc.StatusCode.INTERNAL


def test_error_from_rpc_prefixes_the_peer() -> None:
    err = error_from_rpc(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connect failed"), peer="p:1")
    assert isinstance(err, errors.UnavailableError)
    assert str(err) == "p:1: connect failed"


def test_typed_rpc_errors_reraises_chained() -> None:
    raw = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    with pytest.raises(errors.ResourceExhaustedError, match="decode:7: full") as info:
        with typed_rpc_errors("decode:7"):
            raise raw
    assert info.value.__cause__ is raw


def test_untranslated_peer_error_keeps_its_code() -> None:
    code, message = status_for(FakeRpcError(grpc.StatusCode.ABORTED, "epoch is stale"))
    assert (code, message) == (grpc.StatusCode.ABORTED, "epoch is stale")


async def test_an_exhausted_role_travels_in_the_trailing_metadata() -> None:
    """A decode worker relays its prefill worker's full queue: still RESOURCE_EXHAUSTED,
    the role in a metadata key (never parsed out of the message)."""
    prefill, decode = worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE
    relayed = RoleExhaustedError("prefill p:1: engine queue is full", prefill)
    context = FakeContext()
    await abort_with(context, relayed, "/baton.v1.DecodeWorker/Decode")  # type: ignore[arg-type]
    assert context.aborted is not None
    code, details, trailing = context.aborted
    assert (code, details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, str(relayed))
    assert trailing == ((EXHAUSTED_ROLE_KEY, "WORKER_ROLE_PREFILL"),)
    back = error_from_rpc(FakeRpcError(code, details, trailing), role=decode)
    assert isinstance(back, RoleExhaustedError) and back.role == prefill
    assert str(back) == str(relayed)
    # Without the key: the role of the peer called, when the caller names one.
    bare = FakeRpcError(code, "no free KV blocks")
    own = error_from_rpc(bare, role=decode)
    assert isinstance(own, RoleExhaustedError) and own.role == decode
    assert type(error_from_rpc(bare)) is errors.ResourceExhaustedError
    # A role this side does not know falls back the same way.
    odd = FakeRpcError(code, "full", ((EXHAUSTED_ROLE_KEY, "WORKER_ROLE_GPU_POOL"),))
    assert error_from_rpc(odd, role=decode).role == decode  # type: ignore[attr-defined]
    with pytest.raises(errors.ResourceExhaustedError) as info:
        with typed_rpc_errors("prefill p:1", role=prefill):
            raise bare
    assert isinstance(info.value, RoleExhaustedError) and info.value.role == prefill
    # Other errors carry no role; BOTH or UNSPECIFIED is not a role that runs out.
    other = FakeContext()
    await abort_with(other, errors.AbortedError("stale"), "m")  # type: ignore[arg-type]
    assert other.aborted is not None and other.aborted[2] == ()
    with pytest.raises(ValueError, match="WORKER_ROLE_PREFILL"):
        RoleExhaustedError("full", worker_pb2.WORKER_ROLE_BOTH)
