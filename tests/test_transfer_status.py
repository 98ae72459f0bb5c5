"""Which status a stalled KV transfer ends with (README "Architecture"): a peer that goes
silent is ABORTED, which the gateway retries before the first token; only the client's
own deadline is DEADLINE_EXCEEDED."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine.errors import AbortedError, DeadlineExceededError, UnavailableError
from engine.transfer import pair_group
from rpc.errors import status_for
from tests.test_prefill_handoff import Rig, _acks, rig  # noqa: F401 - the fixture

# What gloo raises when a send or receive outlives the wait we gave it.
GLOO_TIMEOUT = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
    "2000ms for recv operation to complete"
)


def test_a_transport_time_out_is_aborted_not_deadline_exceeded() -> None:
    error = pair_group.link_error(GLOO_TIMEOUT, "request r: receiving layer group 1")
    assert isinstance(error, AbortedError), error
    assert status_for(error)[0] is grpc.StatusCode.ABORTED
    lost = pair_group.link_error(RuntimeError("Connection reset by peer"), "request r: sending")
    assert status_for(lost)[0] is grpc.StatusCode.UNAVAILABLE
    # The same silence, once the job's own deadline has passed, is that deadline.
    past_deadline = pair_group.past_deadline
    late = past_deadline(error, time.monotonic() - 1, "request r: sending")
    assert status_for(late)[0] is grpc.StatusCode.DEADLINE_EXCEEDED
    assert past_deadline(error, time.monotonic() + 60, "request r") is error
    unavailable = UnavailableError("gone")
    assert past_deadline(unavailable, time.monotonic() - 1, "request r") is unavailable


def _stall_the_sender(rig: Rig, seconds: float) -> None:  # noqa: F811
    def stall(request_id: str, group: int) -> None:
        if group == -1:  # before connecting: the transfer makes no progress at all
            time.sleep(seconds)

    rig.outbox.sender._on_group = stall  # type: ignore[attr-defined]


async def test_a_stalled_send_is_aborted_unless_the_client_deadline_ran_out(
    rig: Rig,  # noqa: F811
) -> None:
    """With no client deadline the send job's bound (10 transfer timeouts) is the prefill
    worker's own, and a transfer that outlives it stalled: ABORTED, retried. With one, the
    same stall past it is the client's deadline."""
    _stall_the_sender(rig, 0.6)
    handoff = rig.handoff(stall_s=0.05, beat_s=0.02)  # a budget of 0.5 s
    with pytest.raises(AbortedError, match="did not finish within"):
        async for _ in handoff.run(rig.order("own-budget"), _acks(), None):
            pass
    await rig.settle()
    rig.receiver.cancel("own-budget")  # decode's side of the failed hand-off
    await asyncio.sleep(0.1)
    rig.receiver.poll()
    handoff = rig.handoff(stall_s=30.0, beat_s=0.02)
    with pytest.raises(DeadlineExceededError, match="send deadline passed"):
        async for _ in handoff.run(rig.order("client-deadline"), _acks(), 0.5):
            pass
    await rig.settle()
