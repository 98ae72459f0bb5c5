"""The ports the launcher names for its workers (metrics) are free when the worker binds
them: picked below the kernel's ephemeral range, which outgoing connections and every
bind(0) draw from meanwhile (a worker once exited with 'Address already in use')."""

from __future__ import annotations

import socket

import pytest

from gateway import launcher


def test_a_metrics_port_is_picked_below_the_ephemeral_range() -> None:
    low = launcher.ephemeral_low()
    ports = {launcher._free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (low, sorted(ports))
    assert len(ports) > 1  # picked at random, not one fixed port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when picked


def test_the_ephemeral_range_falls_back_to_linuxs_default(monkeypatch: pytest.MonkeyPatch) -> None:
    class Missing:
        def __init__(self, *_: object) -> None: ...

        def read_text(self) -> str:
            raise OSError("no /proc")

    monkeypatch.setattr(launcher, "Path", Missing)
    assert launcher.ephemeral_low() == launcher.EPHEMERAL_LOW
