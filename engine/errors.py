"""Typed failures that cross the engine boundary.

The engine and the transports raise these; rpc/ maps each one to exactly one gRPC status
code. Plain ``ValueError`` means bad input (INVALID_ARGUMENT). Torch-free.
"""

from __future__ import annotations


class BatonError(Exception):
    """Base class of every typed failure baton raises on purpose."""


class ResourceExhaustedError(BatonError):
    """No capacity right now (KV blocks, queue slots); the caller may retry later."""


class UnavailableError(BatonError):
    """A peer or worker cannot be reached, or is shutting down."""


class DeadlineExceededError(BatonError):
    """A wait ran past its deadline."""


class CancelledError(BatonError):
    """The request was cancelled by its caller (client disconnect, stop string, abort)."""


class AbortedError(BatonError):
    """The request was stopped by a protocol failure: a lost peer, a bad checksum, a stale
    epoch. Retrying the whole request may succeed."""


class InternalError(BatonError):
    """A fault inside this worker (an engine command that raised, a bug), reported to the
    one request it hit; the worker keeps serving the others."""


class UnauthenticatedError(BatonError):
    """The caller did not prove who it is (a missing or unknown API key)."""


class PermissionDeniedError(BatonError):
    """The caller is known but may not do this: a peer outside the worker's fleet, a
    hand-off without the fleet's shared secret."""


class LayoutMismatchError(ValueError, BatonError):
    """Two peers disagree on the KV layout; they must never exchange blocks."""
