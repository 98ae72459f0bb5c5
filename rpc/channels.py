"""Client channels to peer services (one set of options, one channel per address, TLS
when given credentials), and the server options every service shares: size limits,
keepalive both ways, a maximum connection age.

A ``grpc.aio`` channel belongs to the event loop it was created on, so a
:class:`ChannelCache` is owned by one service instance and used from its loop only.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio

logger = logging.getLogger(__name__)

# Between services: prompts of 100k+ token ids (5 bytes each at most) and KV descriptors
# with thousands of block ids fit easily. Larger messages are refused (RESOURCE_EXHAUSTED)
# before they are parsed.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Clients ping idle connections this often, so a dead peer is noticed within
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS rather than at the next call's deadline.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
# A server closes connections older than this (GOAWAY; clients reconnect at once, calls
# in flight get the grace period), so no client holds one connection forever.
MAX_CONNECTION_AGE_MS = 30 * 60_000
MAX_CONNECTION_AGE_GRACE_MS = 10 * 60_000
# ...and connections without a call for this long.
MAX_CONNECTION_IDLE_MS = 10 * 60_000

# A peer that went away (killed, restarting on its address) is redialled at least this
# often. gRPC's default backoff grows to 120 s: a worker back within seconds of a restart
# could then wait tens of seconds for the next dial, out of rotation all that time. Under
# the gateway's default --worker-down-after-s, with gRPC's 20% jitter, so a worker that
# came back is seen before a request gives up waiting for one.
MAX_RECONNECT_BACKOFF_MS = 2_000
MIN_RECONNECT_BACKOFF_MS = 250

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", MIN_RECONNECT_BACKOFF_MS),
    ("grpc.min_reconnect_backoff_ms", MIN_RECONNECT_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

# Servers allow CHANNEL_OPTIONS' pings (no GOAWAY for them), and ping their clients in
# turn: a half-open client (its host gone, no FIN) is dropped within
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, which cancels its calls and frees what they
# held, instead of holding handlers until the OS gives up on the socket.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
    ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
    ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
)

# The public port: a prompt of max_model_len tokens as text is at most
# gateway.validation.MAX_CHARS_PER_TOKEN (32) characters of up to 4 UTF-8 bytes per token;
# the rest of a request (sampling parameters, stop strings) fits in the base.
PUBLIC_BYTES_PER_TOKEN = 128
PUBLIC_BASE_BYTES = 1024 * 1024


def public_message_bytes(max_model_len: int) -> int:
    """The largest request the gateway's public port reads, for a model of
    ``max_model_len`` tokens: a few MiB, not the internal limit."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    return PUBLIC_BASE_BYTES + PUBLIC_BYTES_PER_TOKEN * max_model_len


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> tuple[tuple[str, int], ...]:
    """SERVER_OPTIONS with the largest message a client may send set to
    ``max_message_bytes``."""
    return tuple(
        (name, max_message_bytes if name == "grpc.max_receive_message_length" else value)
        for name, value in SERVER_OPTIONS
    )


ChannelOptions = tuple[tuple[str, int | str], ...]


def make_channel(
    address: str,
    options: ChannelOptions = CHANNEL_OPTIONS,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """A channel to ``host:port`` with baton's keepalive and size limits: TLS with
    ``credentials`` (``rpc.tls``), plaintext without.

    Connects lazily; the caller closes it (``await channel.close()``).
    """
    if not address or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials, options=list(options))


class ChannelCache:
    """One open channel per peer address, created on first use.

    ``get`` never blocks and may be called any number of times. ``drop`` closes a
    peer's channel (a peer that restarted is a new peer: cached state must go);
    ``discard`` does the same without waiting for the close; ``close`` closes them all
    (and waits for discarded ones) and may be called twice.
    """

    def __init__(
        self,
        options: ChannelOptions = CHANNEL_OPTIONS,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._options = options
        self._credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = make_channel(address, self._options, self._credentials)
            self._channels[address] = channel
            logger.debug("opened channel to %s", address)
        return channel

    def __contains__(self, address: str) -> bool:
        return address in self._channels

    def __len__(self) -> int:
        return len(self._channels)

    async def drop(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            logger.info("closing channel to %s", address)
            await channel.close()

    def discard(self, address: str) -> None:
        """Forget ``address``'s channel now and close it in the background. Unlike a
        ``drop`` task that has not run yet, a ``get`` right after it already opens a new
        channel, never the one being closed. Call from the cache's event loop."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            logger.info("closing channel to %s", address)
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
