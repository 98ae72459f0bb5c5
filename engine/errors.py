"""Typed failures that cross the engine boundary.

The engine and the transports raise these; rpc/ maps each one to exactly one gRPC status
code. Plain ``ValueError`` means bad input (INVALID_ARGUMENT). Torch-free.
``drop_frame_locals`` keeps an error that travels far from holding what its frames held.
"""

from __future__ import annotations

import contextlib
import inspect


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


# A generator's or coroutine's frame in a traceback may be suspended, not finished (an
# error raised before, in the event loop, and raised again here): clearing it would
# finalize that generator.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def drop_frame_locals(exc: BaseException) -> None:
    """Clear the locals of the plain function frames that ``exc`` and the errors chained to
    it hold; their tracebacks (files, lines) stay. A frame still running raises
    ``RuntimeError`` and is left alone, and so is every generator and coroutine frame."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if not frame.f_code.co_flags & _SUSPENDABLE:
                with contextlib.suppress(RuntimeError):
                    frame.clear()
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
