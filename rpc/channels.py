"""Client channels to peer services: one set of options, one channel per address.

A ``grpc.aio`` channel belongs to the event loop it was created on, so a
:class:`ChannelCache` is owned by one service instance and used from its loop only.
"""

from __future__ import annotations

import logging

import grpc.aio

logger = logging.getLogger(__name__)

# Prompts of 100k+ token ids and KV descriptors with thousands of block ids fit easily.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Clients ping idle connections this often, so a dead peer is noticed within
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS rather than at the next call's deadline.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

# What a server must allow so that CHANNEL_OPTIONS' pings are not answered with GOAWAY.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
)


def make_channel(
    address: str, options: tuple[tuple[str, int], ...] = CHANNEL_OPTIONS
) -> grpc.aio.Channel:
    """An insecure channel to ``host:port`` with baton's keepalive and size limits.

    Connects lazily; the caller closes it (``await channel.close()``).
    """
    if not address or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    return grpc.aio.insecure_channel(address, options=list(options))


class ChannelCache:
    """One open channel per peer address, created on first use.

    ``get`` never blocks and may be called any number of times. ``drop`` closes a
    peer's channel (a peer that restarted is a new peer: cached state must go);
    ``close`` closes them all and may be called twice.
    """

    def __init__(self, options: tuple[tuple[str, int], ...] = CHANNEL_OPTIONS) -> None:
        self._options = options
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = make_channel(address, self._options)
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

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
