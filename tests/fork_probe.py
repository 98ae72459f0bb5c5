"""What a process sees of itself, as one JSON line: run as ``python -m tests.fork_probe``
fresh or as a fork of ``gateway.fork_server``, so tests can compare the two."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch


def main() -> None:
    seen: list[int] = []
    other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    other.start()
    other.join()
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "nice": os.getpriority(os.PRIO_PROCESS, 0),
                "probe_env": os.environ.get("PROBE"),
                "main_threads": torch.get_num_threads(),
                "other_threads": seen[0],
                "name": __name__,
                # A fork must not inherit the server's own signal handling.
                "sigint": repr(signal.getsignal(signal.SIGINT)),
                "sigterm": repr(signal.getsignal(signal.SIGTERM)),
            }
        ),
        flush=True,
    )
    time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))


if __name__ == "__main__":
    main()
