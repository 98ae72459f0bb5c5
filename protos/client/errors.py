"""Typed errors of the baton client: one class per family of gRPC status codes.

Every failed call raises a :class:`BatonError` subclass carrying the status ``code`` and
the server's ``message`` (which names the bad field for INVALID_ARGUMENT, e.g.
``sampling_params.temperature must be finite and >= 0, got -1.0``). The original
``grpc.RpcError`` is chained as ``__cause__``.

==============================  =========================================  ==========
class                           status codes                               retry?
==============================  =========================================  ==========
:class:`InvalidRequestError`    INVALID_ARGUMENT, OUT_OF_RANGE             no: fix it
:class:`ResourceExhaustedError` RESOURCE_EXHAUSTED                         later
:class:`UnavailableError`       UNAVAILABLE                                yes
:class:`AbortedError`           ABORTED                                    yes
:class:`DeadlineExceededError`  DEADLINE_EXCEEDED                          maybe
:class:`CancelledError`         CANCELLED                                  no
:class:`AuthError`              UNAUTHENTICATED, PERMISSION_DENIED         no
:class:`UnsupportedError`       UNIMPLEMENTED, NOT_FOUND                   no
:class:`ServerError`            INTERNAL, UNKNOWN, DATA_LOSS,              no
                                FAILED_PRECONDITION, ALREADY_EXISTS
==============================  =========================================  ==========

baton answers FAILED_PRECONDITION when two of its workers disagree on the KV layout: a
deployment fault, not the caller's, hence :class:`ServerError`.
"""

from __future__ import annotations

import grpc


class BatonError(Exception):
    """A call to a baton gateway failed. ``code`` is the gRPC status, ``message`` its details."""

    #: Whether the same request may succeed if sent again (after a pause).
    retryable: bool = False

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequestError(BatonError, ValueError):
    """The request is malformed or out of range; the message names the field."""


class ResourceExhaustedError(BatonError):
    """No capacity now (KV blocks, queue slots); retry later, with backoff."""

    retryable = True


class UnavailableError(BatonError):
    """The gateway (or every worker behind it) cannot be reached or is shutting down."""

    retryable = True


class AbortedError(BatonError):
    """A worker-to-worker hand-off failed (a lost peer, a bad checksum); retrying may work."""

    retryable = True


class DeadlineExceededError(BatonError, TimeoutError):
    """The call's deadline passed before it finished."""


class CancelledError(BatonError):
    """The call was cancelled: by :meth:`cancel` on the stream, or by the server."""


class AuthError(BatonError):
    """Missing or refused credentials."""


class UnsupportedError(BatonError):
    """The server does not offer this method (an older or different server)."""


class ServerError(BatonError):
    """The server failed in a way the caller cannot fix (a bug or a deployment fault)."""


_CLASS_OF: dict[grpc.StatusCode, type[BatonError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.PERMISSION_DENIED: AuthError,
    grpc.StatusCode.UNIMPLEMENTED: UnsupportedError,
    grpc.StatusCode.NOT_FOUND: UnsupportedError,
}


def error_for(code: grpc.StatusCode, message: str) -> BatonError:
    """The typed error for a failed status; codes not listed above give :class:`ServerError`."""
    return _CLASS_OF.get(code, ServerError)(code, message)


def error_from_rpc(err: grpc.RpcError) -> BatonError:
    """The typed error for a failed call (sync or asyncio)."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    details = err.details() if callable(getattr(err, "details", None)) else None
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "")
