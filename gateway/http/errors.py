"""Typed errors -> HTTP statuses and OpenAI's error body: the one place the HTTP front end
picks a status (rpc.errors is its gRPC twin, and the two agree).

================================  ======  =======================  ======================
exception                         status  type                     gRPC twin
================================  ======  =======================  ======================
``BodyTooLargeError``             413     invalid_request_error    -
``ModelNotFoundError``            404     invalid_request_error    -
``PromptTooLongError``            400     invalid_request_error    INVALID_ARGUMENT
``LayoutMismatchError``           500     server_error             FAILED_PRECONDITION
``FieldError`` / ``ValueError``   400     invalid_request_error    INVALID_ARGUMENT
``ResourceExhaustedError``        429     rate_limit_error         RESOURCE_EXHAUSTED
``UnavailableError``              503     service_unavailable      UNAVAILABLE
``AbortedError``                  503     service_unavailable      ABORTED
``engine.errors.CancelledError``  503     service_unavailable      CANCELLED
``DeadlineExceededError``         504     timeout_error            DEADLINE_EXCEEDED
``TimeoutError``                  504     timeout_error            DEADLINE_EXCEEDED
``NotImplementedError``           501     server_error             UNIMPLEMENTED
``UnauthenticatedError``          401     authentication_error     UNAUTHENTICATED
``PermissionDeniedError``         403     permission_error         PERMISSION_DENIED
anything else                     500     server_error             INTERNAL (logged)
================================  ======  =======================  ======================

The body is OpenAI's: ``{"error": {"message", "type", "param", "code"}}``, where ``param``
names the request field at fault (a FieldError's ``field``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc

from engine import errors
from gateway.http.request import ModelNotFoundError
from gateway.validation import FieldError, PromptTooLongError
from rpc.errors import error_from_rpc

logger = logging.getLogger(__name__)


class BodyTooLargeError(ValueError):
    """The request body is over the server's limit (HTTP 413)."""


@dataclass(frozen=True, slots=True)
class HttpError:
    """What the client gets for a failed request."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# First match wins, so subclasses come before their bases.
_STATUS_OF: tuple[tuple[type[BaseException], int, str, str | None], ...] = (
    (BodyTooLargeError, 413, "invalid_request_error", "request_too_large"),
    (ModelNotFoundError, 404, "invalid_request_error", "model_not_found"),
    (PromptTooLongError, 400, "invalid_request_error", "context_length_exceeded"),
    (errors.LayoutMismatchError, 500, "server_error", "layout_mismatch"),
    (ValueError, 400, "invalid_request_error", None),
    (errors.ResourceExhaustedError, 429, "rate_limit_error", "no_capacity"),
    (errors.UnavailableError, 503, "service_unavailable", "unavailable"),
    (errors.AbortedError, 503, "service_unavailable", "aborted"),
    (errors.CancelledError, 503, "service_unavailable", "cancelled"),
    (errors.DeadlineExceededError, 504, "timeout_error", "deadline_exceeded"),
    (TimeoutError, 504, "timeout_error", "deadline_exceeded"),
    (NotImplementedError, 501, "server_error", "unimplemented"),
    (errors.UnauthenticatedError, 401, "authentication_error", "invalid_api_key"),
    (errors.PermissionDeniedError, 403, "permission_error", "permission_denied"),
)


def http_error_for(exc: BaseException, request_id: str | None = None) -> HttpError:
    """The status and body for ``exc``; an unexpected one is logged with its traceback."""
    if isinstance(exc, grpc.RpcError):  # a peer call that nobody translated
        exc = error_from_rpc(exc)
    message = str(exc) or type(exc).__name__
    param = (exc.field or None) if isinstance(exc, FieldError) else None
    for kind, status, type_, code in _STATUS_OF:
        if isinstance(exc, kind):
            error = HttpError(status, type_, message, param, code)
            logger.info(
                "request %s: HTTP %d %s: %s", request_id or "-", status, code or type_, message
            )
            return error
    logger.error("request %s failed unexpectedly", request_id or "-", exc_info=exc)
    return HttpError(500, "server_error", f"internal error: {type(exc).__name__}: {message}")
