"""A KV transport that stalls, end to end over gloo with real processes on loopback.

A peer that reached decode's rendezvous store, took a hello number and went silent (a
sender that died between the two steps, or anyone who can reach the store) is a stall
on the transport, not the client's deadline: under a 120 s client deadline the request
completes, retried by the gateway if an attempt is aborted, and it is never reported
as DEADLINE_EXCEEDED (README "Architecture": only the client's own deadline is).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from engine.transfer.store_protocol import KEY_HELLO_COUNT
from tests.e2e_helpers import (
    E2ECluster,
    assert_completed,
    gateway_stub,
    generate,
    ids_request,
    tiny_cluster,
    wait_settled,
)

TRANSFER_TIMEOUT_S = 2.0  # decode's bound on a silent prefill peer
CLIENT_DEADLINE_S = 120.0
# A stalled attempt is aborted after the transfer timeout and retried; the rest is a
# loaded 2-core machine. Far below the client's deadline.
COMPLETES_WITHIN_S = 30.0
_STORE_LINE = re.compile(r"gloo receiver \w+: pool of \d+ blocks, store at ([\w.\-]+):(\d+)")


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[E2ECluster]:
    with tiny_cluster(
        tiny_llama,
        worker_args=("--transport", "gloo", "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)),
        gateway_args=("--max-retries", "3"),
    ) as c:
        yield c


def _decode_store(cluster: E2ECluster) -> dist.TCPStore:
    """A plain client of the decode worker's rendezvous store (its address is logged)."""
    for proc in cluster.procs:
        if proc.kind == "decode":
            found = _STORE_LINE.search(proc.log.read_text(errors="replace"))
            if found:
                host, port = found.group(1), int(found.group(2))
                return dist.TCPStore(host, port, None, False, timedelta(seconds=5))
    raise AssertionError(f"no decode worker logged its store address\n{cluster.logs()}")


async def test_a_silent_peer_at_the_rendezvous_does_not_fail_the_request(
    cluster: E2ECluster,
) -> None:
    store = _decode_store(cluster)
    try:
        store.add(KEY_HELLO_COUNT, 1)  # took a number, and never says hello
        async with gateway_stub(cluster.gateway_address) as stub:
            outcome = await generate(
                stub, ids_request(20, "stalled-rendezvous", max_tokens=8), CLIENT_DEADLINE_S
            )
        assert_completed(outcome, 8, cluster.logs())
        assert outcome.elapsed_s < COMPLETES_WITHIN_S, str(outcome)
        # And the next requests go through as if nothing had happened.
        async with gateway_stub(cluster.gateway_address) as stub:
            again = await generate(
                stub, ids_request(20, "after-stall", max_tokens=8), CLIENT_DEADLINE_S
            )
        assert_completed(again, 8, cluster.logs())
    finally:
        del store
    await wait_settled(cluster.live_workers(), logs=cluster.logs)
