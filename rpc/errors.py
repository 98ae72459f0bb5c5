"""Typed errors <-> gRPC status codes: the one server interceptor, and its client-side inverse.

Server side, :class:`ErrorInterceptor` wraps every async handler (unary, and server- or
bidi-streaming async generators) and turns an escaping exception into exactly one status:

===============================  ======================
exception                        status code
===============================  ======================
``LayoutMismatchError``          FAILED_PRECONDITION
``ValueError`` (bad input)       INVALID_ARGUMENT
``ResourceExhaustedError``       RESOURCE_EXHAUSTED
``UnavailableError``             UNAVAILABLE
``DeadlineExceededError``        DEADLINE_EXCEEDED
``TimeoutError``                 DEADLINE_EXCEEDED
``engine.errors.CancelledError`` CANCELLED
``AbortedError``                 ABORTED
``NotImplementedError``          UNIMPLEMENTED
``UnauthenticatedError``         UNAUTHENTICATED
``PermissionDeniedError``        PERMISSION_DENIED
``InternalError``                INTERNAL (message kept, no traceback: already logged)
anything else                    INTERNAL (traceback logged; the server keeps serving)
===============================  ======================

``asyncio.CancelledError`` (the client went away) is never caught: it must unwind the
handler so its ``finally`` blocks free what the request held. A ``context.abort`` made by
the handler itself passes through untouched.

Client side, :func:`error_from_rpc` and :func:`typed_rpc_errors` map a failed call to a
peer back to the same typed errors, so a service calling a service re-raises a precise
error and the interceptor reports the matching code to its own caller.

RESOURCE_EXHAUSTED also says *whose* capacity ran out, when that is not the worker that
answered: a :class:`RoleExhaustedError` travels as RESOURCE_EXHAUSTED with the role (a
``WorkerRole`` value name) in the trailing metadata key :data:`EXHAUSTED_ROLE_KEY`, and
comes back out of :func:`error_from_rpc` as the same class. So a decode worker relays a
prefill worker's full queue, and the gateway retries on another prefill worker instead of
taking the decode worker for full. Without the key, the worker that answered ran out.

ABORTED also says when it means "this worker is draining, go elsewhere": a
:class:`WorkerDrainingError` travels as ABORTED with :data:`DRAINING_KEY` in the trailing
metadata, so a draining decode worker hands its remaining streams to the gateway, which
moves them to another worker (``gateway.routing.migration``) instead of failing them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import grpc.aio

from engine import errors
from protos.baton.v1 import worker_pb2

logger = logging.getLogger(__name__)

# First match wins, so subclasses come before their bases.
_STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.LayoutMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.CancelledError, grpc.StatusCode.CANCELLED),
    (errors.AbortedError, grpc.StatusCode.ABORTED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.InternalError, grpc.StatusCode.INTERNAL),
)

# The inverse, for calls to peers. Codes not listed become PeerRpcError.
_ERROR_OF: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.FAILED_PRECONDITION: errors.LayoutMismatchError,
    grpc.StatusCode.INVALID_ARGUMENT: ValueError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: errors.UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.CANCELLED: errors.CancelledError,
    grpc.StatusCode.ABORTED: errors.AbortedError,
    grpc.StatusCode.UNAUTHENTICATED: errors.UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDeniedError,
}


# Trailing metadata of a RESOURCE_EXHAUSTED status naming the role whose capacity ran out,
# as a WorkerRole value name (WORKER_ROLE_PREFILL): parsed against the proto enum, never
# read out of the status message.
EXHAUSTED_ROLE_KEY = "baton-exhausted-role"
# The roles that can run out: a worker's own role, never UNSPECIFIED or BOTH.
_EXHAUSTIBLE_ROLES = (worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE)


class RoleExhaustedError(errors.ResourceExhaustedError):
    """No capacity on a worker of ``role`` (``WORKER_ROLE_PREFILL`` or
    ``WORKER_ROLE_DECODE``): RESOURCE_EXHAUSTED, the role in the trailing metadata."""

    def __init__(self, message: str, role: worker_pb2.WorkerRole.ValueType) -> None:
        if role not in _EXHAUSTIBLE_ROLES:
            raise ValueError(
                f"role must be WORKER_ROLE_PREFILL ({worker_pb2.WORKER_ROLE_PREFILL}) or "
                f"WORKER_ROLE_DECODE ({worker_pb2.WORKER_ROLE_DECODE}), got {role}"
            )
        super().__init__(message)
        self.role = role


# Trailing metadata of an ABORTED status from a worker that is draining: the request was
# cut only because the worker is leaving, and may continue on another one.
DRAINING_KEY = "baton-draining"


class WorkerDrainingError(errors.AbortedError):
    """The worker is draining and handed this stream back: ABORTED, with
    :data:`DRAINING_KEY` in the trailing metadata."""


def trailing_metadata_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata the interceptor sends with the status for ``exc``."""
    if isinstance(exc, RoleExhaustedError):
        return ((EXHAUSTED_ROLE_KEY, worker_pb2.WorkerRole.Name(exc.role)),)
    if isinstance(exc, WorkerDrainingError):
        return ((DRAINING_KEY, "1"),)
    return ()


def _trailing_keys(err: grpc.RpcError) -> set[str]:
    read = getattr(err, "trailing_metadata", None)
    pairs = read() if callable(read) else None
    return {key for key, _ in pairs or ()}


def _exhausted_role(err: grpc.RpcError) -> worker_pb2.WorkerRole.ValueType | None:
    """The role a failed call's trailing metadata names as out of capacity, if any."""
    read = getattr(err, "trailing_metadata", None)
    pairs = read() if callable(read) else None
    for key, value in pairs or ():
        if key != EXHAUSTED_ROLE_KEY or not isinstance(value, str):
            continue
        try:
            role = worker_pb2.WorkerRole.Value(value)
        except ValueError:  # a newer peer's role: the caller's default applies
            logger.debug("ignoring %s=%r: not a known WorkerRole", EXHAUSTED_ROLE_KEY, value)
            return None
        return role if role in _EXHAUSTIBLE_ROLES else None
    return None


class PeerRpcError(Exception):
    """A peer failed with a code that has no typed error here (INTERNAL, UNKNOWN, ...).

    Reported to our own caller as INTERNAL: the fault is on the server side of the chain.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message the interceptor sends for ``exc``."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        # A peer call failed and nobody translated it: translate it now.
        exc = error_from_rpc(exc)
    message = str(exc) or type(exc).__name__
    for kind, code in _STATUS_OF:
        if isinstance(exc, kind):
            return code, message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {message}"


def error_from_status(code: grpc.StatusCode, details: str) -> Exception:
    """The typed error for a peer's status; unmapped codes give :class:`PeerRpcError`."""
    kind = _ERROR_OF.get(code)
    return kind(details) if kind is not None else PeerRpcError(code, details)


def error_from_rpc(
    err: grpc.RpcError,
    *,
    peer: str = "",
    role: worker_pb2.WorkerRole.ValueType | None = None,
) -> Exception:
    """The typed error for a failed call; ``peer`` (an address or name) prefixes the message.

    RESOURCE_EXHAUSTED becomes a :class:`RoleExhaustedError` naming the role in its
    trailing metadata, else ``role`` (the role of the peer called), else a plain
    ``ResourceExhaustedError``; ABORTED with :data:`DRAINING_KEY` a
    :class:`WorkerDrainingError`.
    """
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (err.details() if callable(getattr(err, "details", None)) else None) or ""
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    message = f"{peer}: {details}" if peer else details
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        named = _exhausted_role(err)
        if named is None:
            named = role
        if named is not None:
            return RoleExhaustedError(message, named)
    if code is grpc.StatusCode.ABORTED and DRAINING_KEY in _trailing_keys(err):
        return WorkerDrainingError(message)
    return error_from_status(code, message)


@contextlib.contextmanager
def typed_rpc_errors(
    peer: str = "", *, role: worker_pb2.WorkerRole.ValueType | None = None
) -> Iterator[None]:
    """Re-raise a failed call made inside the block as its typed error (chained); ``role``
    as in :func:`error_from_rpc`.

    Works around ``await`` and ``async for`` on a call too::

        with typed_rpc_errors(address):
            async for msg in stub.Decode(request, timeout=t):
                ...
    """
    try:
        yield
    except grpc.RpcError as err:
        raise error_from_rpc(err, peer=peer, role=role) from err


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping any async handler to precise status codes (see module doc).

    Handlers must be ``async def`` functions or async generators; a synchronous handler
    is passed through unwrapped.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        return wrap_handler(handler, lambda behavior: _guard(behavior, method))


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    """End the call with the status for ``exc``; logs a traceback for INTERNAL. Never returns."""
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL and not isinstance(exc, errors.InternalError):
        logger.error("%s failed unexpectedly", method, exc_info=exc)
    else:
        logger.info("%s -> %s: %s", method, code.name, message)
    await context.abort(code, message, trailing_metadata=trailing_metadata_for(exc))


def _guard(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            try:
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc, method)

        return guarded_stream

    if inspect.iscoroutinefunction(behavior):

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc, method)

        return guarded

    return behavior


def wrap_handler(
    handler: grpc.RpcMethodHandler | None,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> grpc.RpcMethodHandler | None:
    """A copy of ``handler`` whose behavior is ``wrap(behavior)``, whatever its call shape.

    ``wrap`` must keep the behavior's kind (coroutine function or async generator
    function), which is how grpc.aio decides how to drive it. ``None`` (an unknown
    method) stays ``None``.
    """
    if handler is None:
        return None
    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **codecs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **codecs)
    return handler
