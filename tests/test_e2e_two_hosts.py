"""A KV hand-off between two hosts: the decode worker runs in a network namespace of its
own, joined to this one by a veth pair, so prefill reaches its KV pool only over the
network, as between pods on two nodes.

Over nixl (UCX on TCP, the chart's cross-node setting) and over gloo, fp32 greedy output
through the gateway equals HF ``generate`` token for token, the KV bytes crossed the veth
link, and every block is free afterwards. The namespace and the link exist only for the
test (root is needed to make them; CI runs as root).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.transfer.nixl_agent import nixl_available
from gateway.launcher import ClusterSpec
from tests.e2e_helpers import (
    E2ECluster,
    assert_completed,
    collect,
    gateway_stub,
    ids_request,
    prompt_ids,
    wait_settled,
)
from tests.engine_helpers import compare_greedy, hf_greedy, hf_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="making a network namespace needs root and iproute2's ip",
    ),
]

NEW_TOKENS = 8
# 1 to 44 blocks of KV: ~0.5 MB in all, far more than the gRPC bytes that also cross
LENGTHS = (7, 300, 700)


@dataclass(frozen=True)
class TwoHosts:
    """This host (``here``) and one in namespace ``netns`` (``there``), joined by the
    veth pair ``link_here`` / ``link_there``."""

    netns: str
    link_here: str
    link_there: str
    here: str
    there: str

    def sent_bytes(self) -> int:
        """Bytes this host has sent to the other one so far."""
        return int(Path(f"/sys/class/net/{self.link_here}/statistics/tx_bytes").read_text())


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[TwoHosts]:
    tag = secrets.token_hex(3)
    octet = int(tag[:2], 16) % 250 + 1  # a /30 of its own, so parallel runs do not collide
    hosts = TwoHosts(
        f"baton-{tag}", f"bt{tag}h", f"bt{tag}t", f"10.231.{octet}.1", f"10.231.{octet}.2"
    )
    _ip("netns", "add", hosts.netns)
    try:
        _ip("link", "add", hosts.link_here, "type", "veth", "peer", "name", hosts.link_there)
        _ip("link", "set", hosts.link_there, "netns", hosts.netns)
        _ip("addr", "add", f"{hosts.here}/30", "dev", hosts.link_here)
        _ip("link", "set", hosts.link_here, "up")
        inside = ("netns", "exec", hosts.netns, "ip")
        _ip(*inside, "addr", "add", f"{hosts.there}/30", "dev", hosts.link_there)
        _ip(*inside, "link", "set", hosts.link_there, "up")
        _ip(*inside, "link", "set", "lo", "up")
        yield hosts
    finally:
        # Deleting the namespace deletes its end of the pair, and with it ours.
        subprocess.run(["ip", "netns", "del", hosts.netns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", hosts.link_here], capture_output=True, timeout=30)


class TwoHostCluster(E2ECluster):
    """Gateway and prefill here, decode on the other host."""

    def __init__(self, spec: ClusterSpec, hosts: TwoHosts, decode_args: list[str]) -> None:
        super().__init__(spec, decode_args=decode_args)
        self.hosts = hosts

    def host_of(self, kind: str) -> str:
        return {"decode": self.hosts.there, "prefill": self.hosts.here}.get(kind, "127.0.0.1")

    def placed(
        self, kind: str, cmd: list[str], env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        # UCX on TCP over the link alone: left to itself it would see one boot id on both
        # sides and take shared memory, which two nodes do not have.
        link = self.hosts.link_there if kind == "decode" else self.hosts.link_here
        env = {**env, "UCX_TLS": "tcp", "UCX_NET_DEVICES": link}
        if kind == "decode":
            cmd = ["ip", "netns", "exec", self.hosts.netns, *cmd]
        return cmd, env


def _transports() -> list:
    nixl = pytest.param(
        "nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 not importable")
    )
    return [nixl, "gloo"]


@pytest.mark.parametrize("transport", _transports())
async def test_a_hand_off_between_two_hosts_gives_hf_greedy_tokens(
    transport: str, two_hosts: TwoHosts, tiny_llama: Path
) -> None:
    spec = ClusterSpec(
        model=str(tiny_llama),
        transport=transport,
        dtype="float32",
        worker_args=("--num-threads", "1"),
        gateway_args=("--stats-interval-s", "0.1", "--local-prefill-tokens", "0"),
        start_timeout_s=180.0,
        log_level="INFO",
    )
    # gloo's store listens where prefill can dial it: the other host's address.
    decode_args = ["--transport-address", f"{two_hosts.there}:0"] if transport == "gloo" else []
    labels = [f"two-hosts-{transport}-{n}" for n in LENGTHS]
    with TwoHostCluster(spec, two_hosts, decode_args) as cluster:
        before = two_hosts.sent_bytes()
        async with gateway_stub(cluster.gateway_address) as stub:
            requests = [
                ids_request(n, label, max_tokens=NEW_TOKENS)
                for n, label in zip(LENGTHS, labels, strict=True)
            ]
            outcomes = await asyncio.gather(
                *[collect(stub.Generate(r, timeout=120)) for r in requests]
            )
        sent = two_hosts.sent_bytes() - before
        hf = hf_model(tiny_llama)
        for outcome, n, label in zip(outcomes, LENGTHS, labels, strict=True):
            assert_completed(outcome, NEW_TOKENS, cluster.logs())
            ours = [t for r in outcome.responses for t in r.token_ids]
            ref, logits = hf_greedy(hf, prompt_ids(n, label), NEW_TOKENS)
            assert compare_greedy(ours, ref, logits) != "mismatch", (label, ours, ref)
        # The prompts' KV (all but each one's last position) went to the other host.
        kv_bytes = _kv_bytes_per_token(hf.config) * sum(n - 1 for n in LENGTHS)
        assert sent >= kv_bytes, f"{sent} bytes crossed the link, the KV alone is {kv_bytes}"
        await wait_settled(cluster.live_workers(), logs=cluster.logs)


def _kv_bytes_per_token(config) -> int:  # noqa: ANN001 - a transformers LlamaConfig
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # fp32
