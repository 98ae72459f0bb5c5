"""Workers on one host lend idle cores and take them back (engine.core_lending), without
gRPC: each CoreLending opens its own file descriptions, so two in one process contend
for the locks as two processes do."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.core_lending import (
    CoreLending,
    Team,
    close_shares,
    create_share,
    parse_seat,
    seat_path,
)
from gateway.core_plan import WorkerCores
from gateway.launcher import ClusterSpec, LocalCluster

P, D = frozenset({0}), frozenset({1})


@pytest.fixture
def shares(tmp_path: Path) -> Path:
    create_share(tmp_path, P, 1)
    create_share(tmp_path, D, 1)
    return tmp_path


def test_a_busy_worker_borrows_an_idle_neighbours_share(shares: Path) -> None:
    prefill, decode = CoreLending(shares, P, 1), CoreLending(shares, D, 1)
    assert decode.team() == Team(P | D, 2)
    assert decode.borrowed_forwards == 1
    prefill.close()
    decode.close()


def test_a_busy_owner_lends_nothing(shares: Path) -> None:
    prefill = CoreLending(shares, P, 1, borrow=False)
    decode = CoreLending(shares, D, 1)
    assert prefill.team() == Team(P, 1)
    assert decode.team() == Team(D, 1)
    prefill.idle()
    assert decode.team() == Team(P | D, 2)
    prefill.close()
    decode.close()


def test_an_owner_waits_for_the_borrowers_next_forward_then_computes_alone(
    shares: Path,
) -> None:
    prefill, decode = CoreLending(shares, P, 1), CoreLending(shares, D, 1)
    assert decode.team().threads == 2  # borrowed while prefill had no work
    got: list[Team] = []
    waiter = threading.Thread(target=lambda: got.append(prefill.team()))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive(), "the owner computed while its share was borrowed"
    assert decode.team() == Team(D, 1)  # the borrower's next forward gives it back
    waiter.join(5)
    assert got == [Team(P, 1)]
    assert prefill.waited_s >= 0.15
    prefill.close()
    decode.close()


def test_an_idle_borrower_gives_back_at_once(shares: Path) -> None:
    prefill, decode = CoreLending(shares, P, 1), CoreLending(shares, D, 1)
    decode.team()
    decode.idle()
    t0 = time.monotonic()
    assert prefill.team() == Team(P | D, 2)  # its own back, and the idle one's lent
    assert time.monotonic() - t0 < 0.1
    prefill.close()
    decode.close()


@contextlib.contextmanager
def busy_worker(directory: Path, cpus: int, seat: int = 0) -> Iterator[subprocess.Popen]:
    """Another process that owns ``{cpus}`` (on ``seat``) and asked for one team of two
    threads, then stays busy; killed on exit."""
    code = (
        "import sys, time; from pathlib import Path; from engine.core_lending import "
        f"CoreLending; c = CoreLending(Path(sys.argv[1]), frozenset({{{cpus}}}), 1, seat={seat}); "
        "print(c.team().threads, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "2"
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_dead_borrowers_share_comes_back_with_its_file_descriptors(shares: Path) -> None:
    with busy_worker(shares, 1) as child:
        prefill = CoreLending(shares, P, 1, reclaim_wait_s=30)
        child.kill()
        child.wait()
        t0 = time.monotonic()
        assert prefill.team() == Team(P | D, 2)  # its own back, and the dead one's idle
        assert time.monotonic() - t0 < 5
        prefill.close()


def test_a_hung_borrower_costs_the_owner_one_bounded_wait(shares: Path) -> None:
    prefill = CoreLending(shares, P, 1, reclaim_wait_s=0.2)
    decode = CoreLending(shares, D, 1)
    decode.team()  # borrows, then never steps again (SIGSTOP)
    t0 = time.monotonic()
    assert prefill.team() == Team(P, 1)
    first = time.monotonic() - t0
    t0 = time.monotonic()
    prefill.team()
    prefill.idle()  # idle and busy again: still no second wait
    prefill.team()
    assert 0.2 <= first < 2 and time.monotonic() - t0 < 0.1
    decode.team()  # it runs again: sees the owner's ask, gives the share back
    t0 = time.monotonic()
    assert prefill.team() == Team(P, 1)
    assert not prefill._gave_up and time.monotonic() - t0 < 0.1
    prefill.close()
    decode.close()


def test_closed_shares_are_given_back_and_not_borrowed(shares: Path) -> None:
    prefill, decode = CoreLending(shares, P, 1), CoreLending(shares, D, 1)
    assert decode.team().threads == 2
    close_shares(shares)
    assert decode.team() == Team(D, 1)
    t0 = time.monotonic()
    assert prefill.team() == Team(P, 1)
    assert time.monotonic() - t0 < 0.1
    prefill.close()
    decode.close()


def test_a_deterministic_worker_lends_but_never_borrows(shares: Path) -> None:
    prefill = CoreLending(shares, P, 1)
    decode = CoreLending(shares, D, 1, borrow=False)
    assert decode.team() == Team(D, 1)
    assert prefill.team() == Team(P, 1)
    prefill.idle()
    decode.idle()
    assert prefill.team() == Team(P | D, 2)  # the deterministic one still lends
    prefill.close()
    decode.close()


def test_two_borrowers_never_hold_one_share(tmp_path: Path) -> None:
    for cpus in ({0}, {1}, {2}):
        create_share(tmp_path, frozenset(cpus), 1)
    a = CoreLending(tmp_path, frozenset({1}), 1)
    b = CoreLending(tmp_path, frozenset({2}), 1)
    assert a.team().threads == 3  # both others idle
    got: list[Team] = []
    waiter = threading.Thread(target=lambda: got.append(b.team()))
    waiter.start()
    time.sleep(0.1)
    assert a.team() == Team(frozenset({0, 1}), 2)  # b wants its share back; {0} stays
    waiter.join(5)
    assert got == [Team(frozenset({2}), 1)]  # {0} is a's: b cannot take it too
    a.idle()
    assert b.team() == Team(frozenset({0, 1, 2}), 3)
    a.close()
    b.close()


def test_share_threads_come_from_the_plan(tmp_path: Path) -> None:
    create_share(tmp_path, frozenset({0, 1}), 2)
    create_share(tmp_path, frozenset({2, 3}), 1)  # a quota left it one thread
    assert CoreLending(tmp_path, frozenset({0, 1}), 2).team() == Team(frozenset(range(4)), 3)
    with pytest.raises(ValueError, match="threads"):
        create_share(tmp_path, frozenset({4}), 0)


@pytest.mark.parametrize(
    ("shares", "files"),
    [
        ([WorkerCores(P, 1), WorkerCores(D, 1)], ["0.0.seat", "0.share", "1.0.seat", "1.share"]),
        (
            [WorkerCores(P, 1), WorkerCores(D, 1), WorkerCores(P, 1)],
            ["0.0.seat", "0.1.seat", "0.share", "1.0.seat", "1.share"],
        ),
        ([WorkerCores(P | D, 1), WorkerCores(P | D, 1), WorkerCores(P | D, 1)], []),
        ([WorkerCores(P | D, 1), WorkerCores(D, 1)], []),
        ([WorkerCores(P, 1)], []),
        ([WorkerCores(P, 1), None], []),
    ],
)
def test_the_launcher_makes_shares_only_where_the_plan_splits_the_cores(
    tmp_path: Path, shares: list[WorkerCores | None], files: list[str]
) -> None:
    cluster = LocalCluster(ClusterSpec(), workdir=tmp_path)
    seats = cluster._lending_seats(shares)
    if not files:
        assert seats == [None] * len(shares) and not cluster._shares_dir.exists()
        return
    made = cluster._shares_dir
    assert sorted(p.name for p in made.iterdir()) == files
    # Each worker sits on its own seat of the share it was planned on.
    assert len(set(seats)) == len(seats)
    for seat, share in zip(seats, shares, strict=True):
        assert seat is not None and share is not None
        assert parse_seat(seat)[:2] == (made, share.cpus)
    off = LocalCluster(ClusterSpec(core_lending=False), workdir=tmp_path / "off")
    assert off._lending_seats([WorkerCores(P, 1), WorkerCores(D, 1)]) == [None, None]


def test_a_seat_names_its_share_and_number(tmp_path: Path) -> None:
    assert parse_seat(tmp_path / "0-3,8.2.seat") == (tmp_path, frozenset({0, 1, 2, 3, 8}), 2)
    for bad in ("0-3.seat", "0-3.x.seat", "0.1.share"):
        with pytest.raises(ValueError, match="core seat"):
            parse_seat(tmp_path / bad)


@pytest.fixture
def co_owned(tmp_path: Path) -> Path:
    """Three workers on two cores: two own P, one owns D."""
    create_share(tmp_path, P, 1, owners=2)
    create_share(tmp_path, D, 1)
    return tmp_path


def test_busy_co_owners_split_up_over_an_idle_share(co_owned: Path) -> None:
    a = CoreLending(co_owned, P, 1, seat=0)
    b = CoreLending(co_owned, P, 1, seat=1)
    assert a.team() == Team(P | D, 2)  # alone at home, D's owner idle: both cores
    assert b.team() == Team(P, 1)  # a co-owner computes here, and D is a's for now
    assert a.team() == Team(D, 1)  # it moves off the crowded share rather than crowd it
    assert b.team() == Team(P, 1)
    b.idle()
    assert a.team() == Team(P | D, 2)  # alone again: home and D
    for w in (a, b):
        w.close()


def test_a_co_owner_is_never_waited_for_and_the_owner_of_a_borrowed_share_is(
    co_owned: Path,
) -> None:
    a = CoreLending(co_owned, P, 1, seat=0)
    b = CoreLending(co_owned, P, 1, seat=1)
    d = CoreLending(co_owned, D, 1)
    assert a.team() == Team(P | D, 2)
    t0 = time.monotonic()
    assert b.team() == Team(P, 1)  # shares its home with a at once
    assert time.monotonic() - t0 < 0.1 and b.waited_s < 0.1
    got: list[Team] = []
    waiter = threading.Thread(target=lambda: got.append(d.team()))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive(), "D's owner computed while a held its share"
    assert a.team() == Team(P, 1)  # D's owner is busy: a gives D back, stays home
    waiter.join(5)
    assert got == [Team(D, 1)]
    d.idle()
    b.idle()
    assert a.team() == Team(P | D, 2)
    for w in (a, b, d):
        w.close()


def test_a_dead_co_owner_does_not_crowd_its_share(co_owned: Path) -> None:
    with busy_worker(co_owned, 0, seat=1) as child:
        a = CoreLending(co_owned, P, 1, seat=0)
        assert a.team() == Team(P, 1)  # the child computes on P and holds D
        child.kill()
        child.wait()
        assert a.team() == Team(P | D, 2)
        a.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to lend one")
def test_a_runner_widens_its_team_and_mask_while_its_neighbour_is_idle(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """A real engine pinned to one CPU, with its neighbour's share idle: its forwards run
    on two threads over both CPUs; once the neighbour computes, on its own again."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    create_share(tmp_path, frozenset({a}), 1)
    create_share(tmp_path, frozenset({b}), 1)
    seat = str(seat_path(tmp_path, frozenset({a}), 0))
    code = f"""
import os, torch
from pathlib import Path
os.sched_setaffinity(0, {{{a}}})
from engine.core_lending import CoreLending
from engine.sampling_params import SamplingParams
from tests.engine_helpers import make_core
core = make_core({str(tiny_llama)!r}, num_threads=1, core_seat={seat!r})
def seen():
    return core.runner.compute.call(
        lambda: (torch.get_num_threads(), sorted(os.sched_getaffinity(0))))
core.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
print(seen(), core.stats().borrowed_forwards, flush=True)
neighbour = CoreLending(Path({str(tmp_path)!r}), frozenset({{{b}}}), 1)
neighbour.team()
core.runner.idle()
core.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
print(seen(), flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path(__file__).parent.parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == f"(2, [{a}, {b}]) 2", out.stdout
    assert lines[1] == f"(1, [{a}])", out.stdout
