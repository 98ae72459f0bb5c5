"""Starting worker processes by forking one that has already imported torch.

``import torch`` is most of a worker's start, paid again by every worker a launcher
starts (a local deployment of the bundled model served after 11.32 s without this and
the gateway's own change, 7.90 s with them:
``benchmarks/results/startup_ab_2026-12-07_avx2_gateway-and-fork.md``). The fork server
(``python -m gateway.fork_server SOCKET MODULE...``) imports torch once and then, for each worker,
forks: the child takes the worker's command line, environment, working directory,
niceness and log file, and runs its module as ``python -m`` would. Children share the
server's pages of torch until they write them.

The server never runs a torch op, so no OpenMP team or other thread exists when it
forks. OpenMP read the server's environment when torch loaded, so the child sets torch's
team size from its own ``OMP_NUM_THREADS``, and variables only read at a process's start
(``PYTHONPATH``, ``LD_PRELOAD``, other OpenMP settings) must equal the server's
(``ForkServer.honours``; the launcher starts a fresh process otherwise).

The child is the server's, so the server reaps it and tells the launcher its exit status
(as ``subprocess.Popen.returncode`` has it: negative for a signal) on the connection
that asked for it. :class:`ForkedProcess` is the launcher's ``Popen`` for it. The
launcher falls back to a plain ``Popen`` for anything else (a gateway, a command another
program wraps, a server that will not start).

One request per connection, as JSON lines; the child's log file travels as a file
descriptor (SCM_RIGHTS)::

    -> {"argv": ["decode_service", ...], "env": {...}, "cwd": "...", "nice": 10} + fd
    <- {"pid": 1234}                    (or {"error": "..."})
    <- {"returncode": 0}                when the child has exited
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import runpy
import select
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import setproctitle

logger = logging.getLogger(__name__)

# Modules a fork of the server may run: the workers, which import torch.
FORKABLE = frozenset({"prefill_service", "decode_service"})
_MAX_REQUEST = 1 << 20


# -- the server -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Request:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    nice: int


def _parse(line: bytes, modules: frozenset[str]) -> _Request:
    data = json.loads(line)
    argv, env, cwd, nice = data["argv"], data["env"], data["cwd"], data.get("nice", 0)
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    if argv[0] not in modules:
        raise ValueError(f"argv[0] must be one of {sorted(modules)}, got {argv[0]!r}")
    if not isinstance(env, dict) or not isinstance(cwd, str) or not isinstance(nice, int):
        raise ValueError("env must be an object, cwd a string and nice an integer")
    return _Request(argv, {str(k): str(v) for k, v in env.items()}, cwd, nice)


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def _serve(path: str, modules: frozenset[str]) -> _Request | None:
    """Answer requests until the launcher is gone. Returns only in a forked child: the
    request it is to run, once every descriptor of the server's is closed there."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
    # A Ctrl-C (SIGINT) or a SIGTERM sent to the launcher's whole process group (GNU
    # timeout, a terminal, a service manager) reaches this server too. The launcher then
    # stops the workers and waits for their exit statuses, which only this server can
    # give: so a Ctrl-C is the launcher's alone, and a SIGTERM ends the server once its
    # last child has exited (at once when it has none).
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    # What this process started with (inherited from the launcher, as a fresh worker's
    # would be: a launcher run in the background ignores SIGINT), for the forks.
    started_with = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    parent = os.getppid()
    while os.getppid() == parent and not (stopping and not children):
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is wake_r:
                with contextlib.suppress(BlockingIOError):
                    wake_r.recv(4096)
                continue
            conn, _ = listener.accept()
            try:
                line, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 1)
                request = _parse(line, modules)
                if len(fds) != 1:
                    raise ValueError(f"expected the log file's descriptor, got {len(fds)}")
            except (OSError, ValueError, KeyError) as exc:
                _send(conn, {"error": f"bad request: {exc}"})
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for sig, handler in started_with.items():  # as a fresh `python -m`'s
                    signal.signal(sig, handler)
                sel.close()
                for sock in (listener, wake_r, wake_w, conn, *children.values()):
                    sock.close()  # this process's copies only
                os.dup2(fds[0], 1)
                os.dup2(fds[0], 2)
                os.close(fds[0])
                return request
            os.close(fds[0])
            children[pid] = conn
            _send(conn, {"pid": pid})
        _reap(children)
    # The launcher is gone (its workers are its own to stop), or a SIGTERM came and no
    # child is left: this server only ends.
    return None


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()


def _become(request: _Request) -> None:
    """Turn this fresh child into ``python -m`` of the request's module."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # The server's own stdio objects wrap descriptors 0-2, which now are the worker's.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
    # What ps, top and pkill -f show: the worker's own command line, not the server's.
    # Before the environment changes: setproctitle finds the space it writes the title
    # into from where the process's environment strings were at its start.
    setproctitle.setproctitle(shlex.join([sys.executable, "-m", *request.argv]))
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    threads = request.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        # OpenMP read the server's environment when torch loaded; this is what it would
        # have read here (the team size of every thread that does not set its own).
        torch.set_num_threads(int(threads))
    if request.nice:
        os.nice(request.nice)
    sys.path[0] = request.cwd  # as `python -m` puts the working directory first
    sys.argv = [request.argv[0], *request.argv[1:]]
    runpy.run_module(request.argv[0], run_name="__main__", alter_sys=True)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m gateway.fork_server SOCKET MODULE [MODULE ...]")
    import torch  # noqa: F401 - the import every child is spared

    request = _serve(sys.argv[1], frozenset(sys.argv[2:]))
    if request is not None:
        _become(request)


# -- the launcher's side --------------------------------------------------------------


class ForkedProcess:
    """``subprocess.Popen``'s surface for a child of the fork server: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, pending: bytes) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn: socket.socket | None = conn
        self._buffer = pending
        self._take()

    def _take(self) -> None:
        if b"\n" in self._buffer and self._conn is not None:
            message = json.loads(self._buffer.split(b"\n", 1)[0])
            self.returncode = int(message["returncode"])
            self._conn.close()
            self._conn = None

    def _read(self, timeout: float | None) -> None:
        if self._conn is None:
            if self.returncode is None:
                self._orphaned()
            return
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return
        chunk = self._conn.recv(4096)
        if chunk:
            self._buffer += chunk
            self._take()
            return
        # The server died before its child: nobody can wait for the child now.
        logger.warning("the fork server died before its child %d", self.pid)
        self._conn.close()
        self._conn = None
        self._orphaned()

    def _orphaned(self) -> None:
        """Whether the child of a dead server still runs (init reaps it; its exit status
        is lost, and is given as killed)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            self.returncode = -signal.SIGKILL

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            # An orphan is polled; a child of a live server is waited for on its socket.
            self._read(0.05 if self._conn is None else left)
            if self._conn is None and self.returncode is None:
                time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # As Popen: nothing once the exit is known (the pid may be someone else's by then).
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# Variables read when a process or a library in it starts (the interpreter, the dynamic
# loader, glibc, the OpenMP runtime as torch loads it), which a fork inherits from the
# server whatever the request's environment says. OMP_NUM_THREADS is not among them:
# the fork sets torch's team size from it (_become).
_READ_AT_START = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "GOMP_", "KMP_", "OMP_", "MKL_")
_READ_LAZILY = frozenset({"OMP_NUM_THREADS"})


def _start_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_START) and k not in _READ_LAZILY}


class ForkServer:
    """A running fork server and the way to ask it for a worker. Start it with
    :func:`shared_fork_server`."""

    def __init__(self, modules: frozenset[str] = FORKABLE, timeout_s: float = 120.0) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="baton-fork-")
        self.path = str(Path(self._dir.name) / "socket")
        self._env = _start_time_env(dict(os.environ))
        log = Path(self._dir.name) / "server.log"
        with log.open("wb") as sink:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.fork_server", self.path, *sorted(modules)],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        end = time.monotonic() + timeout_s
        while not Path(self.path).exists():
            if self._proc.poll() is not None or time.monotonic() > end:
                tail = log.read_text(errors="replace")[-2000:]
                self.close()
                raise RuntimeError(f"the fork server did not start: {tail}")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def honours(self, env: dict[str, str]) -> bool:
        """Whether a fork would run as a fresh process with ``env`` would: the variables
        read at start-up are the server's."""
        return _start_time_env(env) == self._env

    def spawn(
        self, argv: list[str], env: dict[str, str], log: Path, nice: int = 0
    ) -> ForkedProcess:
        """``python -m argv[0] argv[1:]`` as a fork of the server, in this process's
        working directory, with ``env``, at ``nice``, writing to ``log`` (appended)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "nice": nice}
            with log.open("ab") as sink:
                socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [sink.fileno()])
            reply = b""
            while b"\n" not in reply:
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("the fork server closed the connection")
                reply += chunk
        except BaseException:
            conn.close()
            raise
        first, rest = reply.split(b"\n", 1)
        message = json.loads(first)
        if "pid" not in message:
            conn.close()
            raise RuntimeError(f"the fork server refused {argv[0]}: {message.get('error')}")
        # A child that ended at once may have its exit status in the same read.
        return ForkedProcess([sys.executable, "-m", *argv], int(message["pid"]), conn, rest)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._dir.cleanup()


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared_fork_server() -> ForkServer | None:
    """This process's fork server, started on first use and stopped when the process
    exits; None if it cannot start (the caller spawns as usual)."""
    global _shared
    with _shared_lock:
        if _shared is not None and _shared.alive():
            return _shared
        try:
            _shared = ForkServer()
        except (OSError, RuntimeError) as exc:
            logger.warning("no fork server (%s); workers start as fresh processes", exc)
            _shared = None
            return None
        atexit.register(_shared.close)
        return _shared


if __name__ == "__main__":
    main()
