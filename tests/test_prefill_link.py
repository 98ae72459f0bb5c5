"""decode_service.prefill_link: a write that finds the Prefill call already ended (the
prefill worker died between two of decode's messages) raises the call's own typed
error, never grpc's bare "RPC already finished" (which reached clients as INTERNAL)."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from decode_service.prefill_link import GrpcPrefillLink
from engine.errors import AbortedError, UnavailableError
from engine.transfer.handoff import Ack


class _EndedCall:
    """A stream-stream call that has finished with ``code``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    async def write(self, message: object) -> None:
        raise asyncio.InvalidStateError("RPC already finished.")

    async def code(self) -> grpc.StatusCode:
        return self._code

    async def details(self) -> str:
        return self._details

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata()

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return grpc.aio.Metadata()


def _link(call: _EndedCall) -> GrpcPrefillLink:
    link = GrpcPrefillLink.__new__(GrpcPrefillLink)
    link._address, link._rid, link._call = "127.0.0.1:1", "r1", call  # type: ignore[assignment]
    return link


async def test_a_write_to_a_call_its_dead_peer_ended_is_unavailable() -> None:
    link = _link(_EndedCall(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer"))
    with pytest.raises(UnavailableError, match=r"^prefill 127\.0\.0\.1:1: Connection reset"):
        await link.send(Ack(ok=True))


async def test_a_write_after_the_peer_closed_the_stream_cleanly_is_aborted() -> None:
    link = _link(_EndedCall(grpc.StatusCode.OK, ""))
    with pytest.raises(AbortedError, match="ended the stream while decode still had a message"):
        await link.send(Ack(ok=True))
