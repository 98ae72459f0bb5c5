"""How the client connects: channel options, plain or TLS, sync or asyncio.

The options match what baton's servers allow (``rpc/channels.py``, which the client does
not import: it must install without the server's code): large messages for long prompts,
and keepalive pings so that a dead gateway is noticed in ~30 s instead of at the deadline.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import grpc
import grpc.aio


class _Default(enum.Enum):
    TIMEOUT = "the client's default timeout"


#: A method's ``timeout`` when not given: the client's own default. Distinct from None,
#: which means no deadline at all.
DEFAULT_TIMEOUT = _Default.TIMEOUT
#: Seconds, None (no deadline) or DEFAULT_TIMEOUT.
Timeout = float | None | _Default

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


def _options(extra: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    """CHANNEL_OPTIONS, with any option named in ``extra`` replaced by its value there."""
    named = {name for name, _ in extra}
    return [(n, v) for n, v in CHANNEL_OPTIONS if n not in named] + list(extra)


def _check(address: str) -> None:
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"address must be 'host:port' or a gRPC target, got {address!r}")


def sync_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, object]],
) -> grpc.Channel:
    _check(address)
    if credentials is None:
        return grpc.insecure_channel(address, options=_options(options))
    return grpc.secure_channel(address, credentials, options=_options(options))


def aio_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, object]],
) -> grpc.aio.Channel:
    _check(address)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=_options(options))
    return grpc.aio.secure_channel(address, credentials, options=_options(options))


def resolve_timeout(timeout: Timeout, default: float | None) -> float | None:
    """The deadline in seconds for a call given ``timeout`` and the client's ``default``."""
    return default if timeout is DEFAULT_TIMEOUT else timeout  # type: ignore[return-value]
