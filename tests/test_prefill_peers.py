"""decode_service.prefill_peers on a hand-set clock: what a decode worker keeps for the
prefill workers it dialled, and when it lets go (no gRPC, no transport)."""

from __future__ import annotations

import pytest

from decode_service.prefill_fleet import PrefillFleet
from decode_service.prefill_peers import PeerLimits, PrefillPeers
from engine.transfer.base import TransferConfig

LIMITS = PeerLimits(idle_s=100.0, departed_idle_s=10.0)


class Rig:
    def __init__(self, departed: set[str] | None = None) -> None:
        self.now = 0.0
        self.forgotten: list[str] = []
        self.dropped: list[str] = []
        self.departed = departed if departed is not None else set()
        self.peers = PrefillPeers(
            self.forgotten.append,
            drop_channel=self.dropped.append,
            departed=lambda address: address in self.departed,
            limits=LIMITS,
            clock=lambda: self.now,
        )

    def hand_off(self, address: str, sender: str, *, lasting: float = 1.0) -> None:
        """One hand-off stream to ``address`` whose sender reports ``sender``."""
        self.peers.begin(address)
        self.peers.note_sender(address, sender)
        self.now += lasting
        self.peers.end(address)


def test_an_idle_prefill_address_is_dropped_with_its_channel_and_sender() -> None:
    rig = Rig()
    rig.hand_off("10.0.0.1:5", "s1")
    rig.now += LIMITS.idle_s - 1
    assert rig.peers.prune() == []
    assert "10.0.0.1:5" in rig.peers and rig.peers.sender_at("10.0.0.1:5") == "s1"
    rig.now += 2
    assert rig.peers.prune() == ["10.0.0.1:5"]
    assert (rig.dropped, rig.forgotten) == (["10.0.0.1:5"], ["s1"])
    assert "10.0.0.1:5" not in rig.peers and rig.peers.address_of("s1") is None
    assert rig.peers.prune() == []  # dropped once


def test_an_address_with_a_stream_open_is_never_dropped() -> None:
    rig = Rig(departed={"10.0.0.1:5"})
    rig.peers.begin("10.0.0.1:5")
    rig.peers.note_sender("10.0.0.1:5", "s1")
    rig.now += 10 * LIMITS.idle_s  # a long decode
    assert rig.peers.prune() == []
    rig.peers.end("10.0.0.1:5")  # idle from now on
    assert rig.peers.prune() == []
    rig.now += LIMITS.departed_idle_s + 1
    assert rig.peers.prune() == ["10.0.0.1:5"]


def test_an_address_that_left_discovery_goes_after_the_shorter_bound() -> None:
    rig = Rig()
    rig.hand_off("10.0.0.1:5", "old-pod")  # the pod is replaced: a new IP, a new sender
    rig.hand_off("10.0.0.2:5", "new-pod")
    rig.now += LIMITS.departed_idle_s + 1
    assert rig.peers.prune() == []  # still in the answer: only the long bound applies
    rig.departed.add("10.0.0.1:5")
    rig.hand_off("10.0.0.2:5", "new-pod")  # pruning rides on the traffic that goes on
    assert (rig.dropped, rig.forgotten) == (["10.0.0.1:5"], ["old-pod"])
    assert rig.peers.address_of("new-pod") == "10.0.0.2:5"


def test_a_sender_back_on_a_new_address_is_recognized_and_the_old_address_dropped() -> None:
    rig = Rig()
    rig.hand_off("10.0.0.1:5", "s1")
    rig.peers.begin("10.0.0.1:5")  # a stream still open on the old address
    rig.hand_off("10.0.0.9:5", "s1")  # the same incarnation, now reached elsewhere
    assert rig.peers.address_of("s1") == "10.0.0.9:5"
    assert rig.dropped == []  # the open stream keeps the old channel
    rig.peers.end("10.0.0.1:5")
    assert rig.dropped == ["10.0.0.1:5"] and "10.0.0.1:5" not in rig.peers
    assert rig.forgotten == []  # the sender itself lives on: its connections stay
    rig.now += LIMITS.idle_s + 1
    assert rig.peers.prune() == ["10.0.0.9:5"]
    assert rig.forgotten == ["s1"]  # idle at its last address: now it goes


def test_a_restart_at_the_same_address_forgets_the_old_sender_unless_it_moved() -> None:
    rig = Rig()
    rig.hand_off("p:1", "s1")
    rig.hand_off("p:1", "s2")  # restarted in place
    assert rig.forgotten == ["s1"] and rig.dropped == []
    assert rig.peers.sender_at("p:1") == "s2"
    rig.peers.begin("p:1")  # a stream open on p:1 keeps its entry (sender s2) while ...
    rig.hand_off("p:2", "s2")  # ... s2 is reached at p:2 ...
    rig.hand_off("p:1", "s3")  # ... and a new worker answers at p:1: s2 is not gone
    rig.peers.end("p:1")
    assert rig.forgotten == ["s1"]
    assert rig.peers.address_of("s2") == "p:2" and rig.peers.sender_at("p:1") == "s3"


def test_limits_outlast_the_senders_own_idle_bound_and_are_checked() -> None:
    # A live sender drops its connection here after peer_idle_s without a job; only then
    # may the receiver forget it without cutting a connection in use.
    assert PeerLimits().idle_s > TransferConfig().peer_idle_s + 1
    assert PeerLimits().departed_idle_s < PeerLimits().idle_s
    with pytest.raises(ValueError, match="PeerLimits.idle_s must be > 0"):
        PeerLimits(idle_s=0)


async def test_the_fleet_says_which_addresses_left_the_dns_answer() -> None:
    answers = {"prefill": ["10.0.0.1"]}

    async def lookup(name: str, port: int) -> list[str]:
        return list(answers.get(name, []))

    fleet = PrefillFleet(["dns:///prefill:5", "10.0.0.7"], lookup=lookup, resolve_interval_s=0.01)
    await fleet.check("10.0.0.1:5")
    assert not fleet.departed("10.0.0.1:5")
    answers["prefill"] = ["10.0.0.2"]  # 10.0.0.1 is replaced by 10.0.0.2
    await fleet.check("10.0.0.2:5")  # a miss: looked up again
    assert fleet.departed("10.0.0.1:5") and not fleet.departed("10.0.0.2:5")
    await fleet.check("10.0.0.1:5")  # still admitted for retain_s, yet departed
    assert not fleet.departed("10.0.0.7:5")  # a fixed entry never departs
    assert not PrefillFleet([]).departed("anywhere:1")  # nor does anything in an open one
