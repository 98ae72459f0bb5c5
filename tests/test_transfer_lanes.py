"""One silent receiver holds up only the jobs sent to it.

A prefill worker sends to many decode workers from one sender. A receiver that stops
answering (it never gives a verdict on the hello) or whose address has become a black
hole (a deleted pod's IP, which the link probe waits on) must not delay a transfer to
any other receiver, and the silent one's job ends, retryably, after the connect timeout
rather than at the job's deadline. A failed send's error, which travels on to the
request's handler, does not keep the link's process group alive through its frames.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from engine.errors import AbortedError, UnavailableError
from engine.kv_layout import KVLayout
from engine.transfer.base import KVDescriptor, KVEndpoint, SendJob, TransferConfig
from engine.transfer.factory import make_receiver, make_sender
from engine.transfer.queued_sender import PeerLink, QueuedSender, StopCheck
from engine.transfer.store_protocol import KEY_INCARNATION, KEY_LAYOUT, encode_layout
from tests.transfer_peer import (
    SMALL_GROUPS,
    blocks,
    random_pool,
    small_layout,
    transfer_threads,
    wait_for,
)

CONNECT_S = 3.0
QUICK = dataclasses.replace(SMALL_GROUPS, connect_timeout_s=CONNECT_S)


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    """No transport thread outlives its closed owner (gloo makes no shm segments, and
    other processes' may come and go meanwhile)."""
    yield
    end = time.monotonic() + 5
    while transfer_threads() and time.monotonic() < end:
        time.sleep(0.01)
    assert transfer_threads() == []


def silent_receiver(layout: KVLayout) -> tuple[dist.TCPStore, KVEndpoint]:
    """A store that looks like a gloo receiver's but never answers a hello: a decode
    worker that is stopped, overloaded or wedged."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    incarnation = uuid.uuid4().hex
    store.set(KEY_LAYOUT, encode_layout(layout))
    store.set(KEY_INCARNATION, incarnation)
    return store, KVEndpoint("gloo", f"127.0.0.1:{store.port}", incarnation, layout, 32)


def test_a_silent_receiver_does_not_delay_a_transfer_to_another() -> None:
    layout = small_layout()
    source = random_pool(layout, 16, seed=3)
    store, endpoint = silent_receiver(layout)
    live = make_receiver("gloo", layout, 32, config=QUICK)
    sender = make_sender("gloo", source, layout, QUICK)
    try:
        stuck = KVDescriptor(endpoint, "stuck", (1, 2), 1, 11)
        began = time.monotonic()
        # The client's deadline is far away: only the connect timeout may end the wait.
        sender.submit(SendJob("stuck", (0, 1), stuck, began + 120))
        time.sleep(0.2)  # the stuck job is waiting for its verdict
        desc = live.expect("live", (5, 6), 2, began + 60)
        sender.submit(SendJob("live", (3, 4), desc, began + 60))
        sent = wait_for(sender.poll, 30)
        assert sent.request_id == "live" and sent.ok, sent.error
        # Well before the silent receiver's connect timeout could have released the lane.
        assert time.monotonic() - began < CONNECT_S - 0.5
        live.verify("live", sent.checksum or 0, 2)
        assert wait_for(live.poll, 20).ok
        assert bool((blocks(live.kv_cache, (5, 6)) == blocks(source, (3, 4))).all())
        failed = wait_for(sender.poll, 30)
        # A silent peer, not the client's deadline: retryable, after the connect timeout.
        assert failed.request_id == "stuck" and isinstance(failed.error, AbortedError), failed
        assert "did not answer hello" in str(failed.error)
        assert time.monotonic() - began < CONNECT_S + 10
    finally:
        sender.close()
        live.close()
        del store


class _FakeLink(PeerLink):
    def __init__(self, address: str, probe_s: float, probes: list[float]) -> None:
        self.incarnation = "fake"
        self._probe_s = probe_s if address == "black-hole" else 0.0
        self._probes = probes if address == "black-hole" else []

    def send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        stop(0)
        return 0, 0

    def gone(self) -> bool:
        self._probes.append(time.monotonic())
        time.sleep(self._probe_s)  # a connect to an address that drops every packet
        return False

    def close(self) -> None:
        pass


class _FakeSender(QueuedSender):
    kind = "fake"
    probe_s = 1.5

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.probes: list[float] = []
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _connect(self, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        return _FakeLink(endpoint.address, self.probe_s, self.probes)


def _job(layout: KVLayout, address: str, rid: str) -> SendJob:
    endpoint = KVEndpoint("fake", address, "fake", layout, 8)
    return SendJob(rid, (0,), KVDescriptor(endpoint, rid, (1,), 1, 5), time.monotonic() + 30)


def test_probing_a_black_holed_receiver_never_delays_jobs_to_a_live_one() -> None:
    layout = small_layout()
    sender = _FakeSender(random_pool(layout, 4, seed=1), layout, TransferConfig())
    try:
        sender.submit(_job(layout, "black-hole", "first"))
        assert wait_for(sender.poll).ok  # a link to it is cached: it will be probed
        worst = 0.0
        end = time.monotonic() + 5.0
        i = 0
        while time.monotonic() < end:
            submitted = time.monotonic()
            sender.submit(_job(layout, "live", f"live-{i}"))
            done = wait_for(sender.poll, 10)
            assert done.ok, done.error
            worst = max(worst, time.monotonic() - submitted)
            i += 1
            time.sleep(0.05)
        assert sender.probes, "the idle link was never probed"
        # Each probe blocks for 1.5 s; a job that waited on one would show it.
        assert worst < 0.75, f"a job to the live receiver waited {worst:.2f} s"
        # Probes back off: over 5 s, never one a second.
        assert len(sender.probes) <= 3, sender.probes
    finally:
        sender.close()


def test_lanes_run_side_by_side_and_end_when_idle() -> None:
    layout = small_layout()
    quick = TransferConfig(peer_idle_s=0.4)
    sender = _FakeSender(random_pool(layout, 4, seed=1), layout, quick)
    gate = threading.Event()
    sender._on_group = lambda rid, group: gate.wait(10) if rid == "held" else None  # type: ignore[attr-defined]
    try:
        sender.submit(_job(layout, "a", "held"))
        sender.submit(_job(layout, "b", "free"))
        assert wait_for(sender.poll).request_id == "free"
        gate.set()
        assert wait_for(sender.poll).request_id == "held"
        assert sender.num_links == 2
        end = time.monotonic() + 5
        while sender.num_links and time.monotonic() < end:
            time.sleep(0.02)
        assert sender.num_links == 0
    finally:
        sender.close()


class _Held:
    """Stands for a link's process group: what a failed send's frames must let go of."""


class _FailingLink(PeerLink):
    incarnation = "fake"

    def __init__(self, held: list[weakref.ref[_Held]], error: BaseException | None) -> None:
        self._held = held
        self._error = error

    def send(self, job: SendJob, stop: StopCheck) -> tuple[int, int]:
        group = _Held()  # a local of the failing frame, as GlooLink._send's ``pg`` is
        self._held.append(weakref.ref(group))
        if self._error is not None:
            raise self._error
        try:
            raise RuntimeError("connection reset by peer")
        except RuntimeError as exc:
            self.broken = True
            raise UnavailableError(f"request {job.request_id}: peer lost ({exc})") from exc

    def close(self) -> None:
        pass


class _FailingSender(QueuedSender):
    kind = "fake"

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.held: list[weakref.ref[_Held]] = []
        self.error: BaseException | None = None  # what send raises (None: its own)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _connect(self, endpoint: KVEndpoint, deadline: float) -> PeerLink:
        return _FailingLink(self.held, self.error)


def test_a_failed_send_reports_its_error_without_holding_the_links_state() -> None:
    layout = small_layout()
    sender = _FailingSender(random_pool(layout, 4, seed=1), layout, TransferConfig())
    gc.disable()  # a reference cycle would otherwise be collected by chance
    try:
        sender.submit(_job(layout, "a", "lost"))
        failed = wait_for(sender.poll)
        assert isinstance(failed.error, UnavailableError) and "peer lost" in str(failed.error)
        assert failed.error.__traceback__ is not None  # where it failed is still told
        (held,) = sender.held
        assert held() is None, "the failed send's frames still hold the link's state"
    finally:
        gc.enable()
        sender.close()


def test_a_failed_sends_error_raised_before_in_a_suspended_generator_leaves_it_alone() -> None:
    # An error first raised (and caught) inside a generator or coroutine that is now
    # suspended carries that frame in its traceback; clearing it would finalize the
    # generator (a request handler, in the event loop).
    def handler() -> Iterator[object]:
        try:
            raise UnavailableError("the receiver is draining")
        except UnavailableError as exc:
            yield exc
        yield "resumed"

    suspended = handler()
    reason = next(suspended)
    layout = small_layout()
    sender = _FailingSender(random_pool(layout, 4, seed=1), layout, TransferConfig())
    sender.error = reason
    try:
        sender.submit(_job(layout, "a", "drained"))
        failed = wait_for(sender.poll)
        assert failed.error is reason
        assert next(suspended) == "resumed"
    finally:
        sender.close()
