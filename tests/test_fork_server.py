"""gateway.fork_server: a worker forked from the server runs as ``python -m`` would (its
command line, environment, working directory, niceness and log), its exit status comes
back as ``Popen`` gives it, and what it cannot honour is refused or left to ``Popen``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.fork_server import ForkServer


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fork = ForkServer()
    yield fork
    fork.close()
    assert not fork.alive()


def _config(log: Path) -> dict:
    return json.loads(log.read_text().strip().splitlines()[-1])["config"]


def test_a_fork_takes_its_command_line_environment_directory_and_log(
    server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "worker.log"
    env = {**os.environ, "BATON_DECODE_MAX_NUM_SEQS": "7", "OMP_NUM_THREADS": "1"}
    monkeypatch.chdir(tmp_path)
    proc = server.spawn(
        ["decode_service", "--model", "some-model", "--grace-s", "3", "--check-config"],
        env,
        log,
    )
    assert proc.wait(60) == 0
    config = _config(log)
    assert config["engine"]["max_num_seqs"] == 7  # from the environment it was given
    assert config["grace_s"] == 3.0  # from its command line
    assert config["engine"]["model"] == "some-model"


def _serving(model: Path) -> list[str]:
    """A decode worker that serves the tiny model until it is stopped."""
    return ["decode_service", "--model", str(model), "--dtype", "float32", "--num-blocks", "64",
            "--host", "127.0.0.1", "--port", "0"]  # fmt: skip


def test_a_fork_runs_at_its_niceness_in_its_directory_under_its_own_name(
    server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "worker.log"
    argv = [*_serving(tiny_llama), "--port-file", "relative.port"]
    proc = server.spawn(argv, dict(os.environ), log, 7)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "relative.port").exists():  # relative to its directory
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.05)
        stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(stat[16]) == os.getpriority(os.PRIO_PROCESS, 0) + 7
        assert Path(f"/proc/{proc.pid}/cwd").resolve() == tmp_path.resolve()
        # ps and pkill -f see the worker's command line, not the fork server's.
        shown = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert f"-m decode_service --model {tiny_llama}" in shown, shown
        assert "fork_server" not in shown
        proc.terminate()
        assert proc.wait(30) == 0  # a drained worker exits 0
    finally:
        proc.kill()
        proc.wait(30)


def test_exit_statuses_come_back_as_popen_gives_them(
    server: ForkServer, tmp_path: Path, tiny_llama: Path
) -> None:
    bad = server.spawn(["decode_service", "--no-such-flag"], dict(os.environ), tmp_path / "a")
    assert bad.wait(60) == 2
    assert bad.poll() == 2 and bad.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "a").read_text()

    slow = server.spawn(_serving(tiny_llama), dict(os.environ), tmp_path / "b")
    with pytest.raises(subprocess.TimeoutExpired):
        slow.wait(0.01)
    slow.send_signal(signal.SIGKILL)
    assert slow.wait(30) == -signal.SIGKILL
    slow.kill()  # after the exit: nothing to signal, as Popen
    assert slow.returncode == -signal.SIGKILL


def test_only_workers_are_forked(server: ForkServer, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="argv\\[0\\] must be one of"):
        server.spawn(["gateway", "--help"], dict(os.environ), tmp_path / "log")


def test_a_fork_sees_what_a_fresh_process_sees(tmp_path: Path) -> None:
    """Command line, directory, niceness, environment, exit status and torch's team size
    in the main thread and in a thread that never set its own (OpenMP read the server's
    environment when torch loaded there)."""
    probe = ForkServer(modules=frozenset({"tests.fork_probe"}))
    try:
        for threads in ("1", "2"):
            env = {**os.environ, "OMP_NUM_THREADS": threads, "PROBE": "x", "PROBE_EXIT": "3"}
            fresh = subprocess.run(
                ["nice", "-n", "4", sys.executable, "-m", "tests.fork_probe", "a", "b"],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert fresh.returncode == 3, fresh.stderr
            log = tmp_path / f"probe-{threads}.log"
            forked = probe.spawn(["tests.fork_probe", "a", "b"], env, log, nice=4)
            assert forked.wait(60) == 3
            assert json.loads(log.read_text()) == json.loads(fresh.stdout)
    finally:
        probe.close()


def test_a_signal_to_the_launchers_group_leaves_the_server_until_its_children_exit(
    tmp_path: Path,
) -> None:
    """A Ctrl-C or a group-wide SIGTERM hits the server too: it stays to report its
    children's exit statuses, and a SIGTERM ends it once they have exited."""
    probe = ForkServer(modules=frozenset({"tests.fork_probe"}))
    try:
        env = {**os.environ, "PROBE_SLEEP": "3", "PROBE_EXIT": "5"}
        child = probe.spawn(["tests.fork_probe"], env, tmp_path / "log")
        time.sleep(0.5)
        probe._proc.send_signal(signal.SIGINT)
        probe._proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert probe.alive() and child.poll() is None
        assert child.wait(30) == 5  # its own status, not a lost child's
        probe._proc.wait(10)  # then the server ends by itself
        assert not probe.alive()
    finally:
        probe.close()


def test_an_environment_read_at_start_up_is_not_the_forks_to_honour(
    server: ForkServer,
) -> None:
    env = dict(os.environ)
    assert server.honours({**env, "OMP_NUM_THREADS": "3", "BATON_X": "1"})
    assert not server.honours({**env, "PYTHONPATH": "/elsewhere"})
    assert not server.honours({**env, "LD_PRELOAD": "libjemalloc.so"})
    assert not server.honours({**env, "OMP_PROC_BIND": "close"})


def test_a_child_of_a_server_that_died_is_still_told_apart(
    tmp_path: Path, tiny_llama: Path
) -> None:
    fork = ForkServer()
    proc = fork.spawn(_serving(tiny_llama), dict(os.environ), tmp_path / "log")
    try:
        fork._proc.kill()
        fork._proc.wait()
        assert proc.poll() is None  # orphaned, but running
        os.kill(proc.pid, signal.SIGKILL)
        end = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
        fork.close()


def test_baton_serve_forks_workers_by_default_and_no_fork_workers_turns_it_off() -> None:
    from gateway.cli import _parser, _spec

    assert _spec(_parser().parse_args(["serve"])).fork_workers is True
    assert _spec(_parser().parse_args(["run", "--no-fork-workers", "hi"])).fork_workers is False


def test_the_launcher_forks_workers_only_where_a_fork_runs_as_a_fresh_process(
    tmp_path: Path,
) -> None:
    from gateway.fork_server import ForkedProcess
    from gateway.launcher import ClusterSpec, LocalCluster

    class Elsewhere(LocalCluster):
        """Places its processes on another host, as tests/test_e2e_two_hosts.py does."""

        def placed(self, kind: str, cmd: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
            return ["ip", "netns", "exec", "h1", *cmd], env

    def forked(cluster: LocalCluster, kind: str, env: dict[str, str]) -> bool:
        argv = ["decode_service", "--check-config"]
        proc = cluster._forked(kind, argv, env, tmp_path / f"{kind}.log", 0)
        if proc is not None:
            assert isinstance(proc, ForkedProcess) and proc.wait(60) == 0
        return proc is not None

    env = dict(os.environ)
    here = LocalCluster(ClusterSpec(), workdir=tmp_path / "here")
    assert forked(here, "decode", env)
    assert forked(here, "decode", {**env, "OMP_NUM_THREADS": "1"})
    assert not forked(here, "gateway", env)  # never imports torch
    assert not forked(here, "decode", {**env, "PYTHONPATH": "/elsewhere"})
    off = LocalCluster(ClusterSpec(fork_workers=False), workdir=tmp_path / "off")
    assert not forked(off, "decode", env)
    assert not forked(Elsewhere(ClusterSpec(), workdir=tmp_path / "there"), "decode", env)
