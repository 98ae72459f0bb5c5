"""API keys at the gateway: who may call it.

Keys come from a file (one per line; blank lines and ``#`` comments ignored), read once at
start-up. A call must carry ``authorization: Bearer <key>`` (gRPC metadata, or the HTTP
``Authorization`` header); anything else is UNAUTHENTICATED (HTTP 401). Only SHA-256
digests of the keys are kept, a presented key is compared with every one of them in
constant time (``hmac.compare_digest``, no early exit), and no key, presented or stored,
is ever logged or shown by ``repr``.

The health service stays open, so probes work without a key.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health

from engine.errors import UnauthenticatedError
from rpc.errors import wrap_handler

AUTHORIZATION = "authorization"
_SCHEME = "bearer"
# Printable ASCII without spaces: what fits in a header value unquoted.
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
MIN_KEY_CHARS = 16
REFUSAL = "a valid API key is required: send 'authorization: Bearer <key>'"


class ApiKeys:
    """The accepted keys, as digests. ``check`` is the only question it answers."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("at least one API key is required")
        self._digests = tuple(_digest(k) for k in keys)

    @classmethod
    def from_file(cls, path: Path, flag: str = "--api-keys-file") -> ApiKeys:
        """Read ``path``; ValueError names the flag and the line (never the key)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{flag}={str(path)!r} cannot be read: {err}") from err
        keys = []
        for number, line in enumerate(text.splitlines(), 1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if len(key) < MIN_KEY_CHARS or not set(key) <= _KEY_CHARS:
                raise ValueError(
                    f"{flag}: line {number} is not a usable key (at least {MIN_KEY_CHARS} "
                    "printable ASCII characters, no spaces)"
                )
            keys.append(key)
        if not keys:
            raise ValueError(f"{flag}={str(path)!r} holds no keys")
        return cls(keys)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def check(self, presented: str | None) -> bool:
        """True when ``presented`` is one of the keys; the time taken does not depend on
        which key matched, or on how much of one did."""
        digest = _digest(presented or "")
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(digest, known)
        return found and presented is not None

    def check_header(self, value: str | None) -> bool:
        """``check`` on the key of an ``authorization`` value (``Bearer <key>``)."""
        return self.check(bearer_token(value))


def bearer_token(value: str | None) -> str | None:
    """The token of ``Bearer <token>`` (scheme case-insensitive), else None."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != _SCHEME or not token.strip():
        return None
    return token.strip()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid key with UNAUTHENTICATED (health exempt).

    The refusal is raised inside the call, so ``ErrorInterceptor`` (outside this one)
    stays the only place that picks a status code; the handler never runs.
    """

    def __init__(self, keys: ApiKeys) -> None:
        self._keys = keys
        self._exempt = f"/{health.SERVICE_NAME}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(self._exempt):
            return handler
        values = [
            v
            for k, v in (handler_call_details.invocation_metadata or ())
            if k == AUTHORIZATION and isinstance(v, str)
        ]
        if len(values) == 1 and self._keys.check_header(values[0]):
            return handler
        return wrap_handler(handler, _refuse)


def _refuse(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def refused_stream(request: Any, context: Any) -> Any:
            raise UnauthenticatedError(REFUSAL)
            yield  # an async generator, like the handler it replaces

        return refused_stream

    async def refused(request: Any, context: Any) -> Any:
        raise UnauthenticatedError(REFUSAL)

    return refused
