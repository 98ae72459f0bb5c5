#!/bin/sh
# cuda-toolchain.sh VARIANT OFFLINE: the build step (k8s/Dockerfile) that gives the CUDA
# image what Triton needs at run time. Triton compiles each kernel's launcher, a Python C
# extension, with a C compiler at first use: so gcc, libc headers and Python.h must be in
# the image (torch's CUDA wheels carry everything else; the node mounts the driver).
# The CPU variant needs none of it and gets nothing. With OFFLINE=1 nothing can be
# installed: BASE_IMAGE must carry them already (mmdebstrap --include=gcc,libc6-dev).
# The build fails here, naming what is missing, rather than the worker at its first start.
set -eu
variant="$1"
offline="$2"
if [ "$variant" != cuda ]; then
  exit 0
fi
include="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
missing=""
if ! command -v gcc >/dev/null 2>&1; then
  missing="gcc libc6-dev"
fi
if [ ! -f "$include/Python.h" ]; then
  missing="$missing python3-dev"
fi
if [ -n "$missing" ]; then
  if [ "$offline" = 1 ]; then
    echo "the CUDA variant needs $missing in BASE_IMAGE when OFFLINE=1 (Triton builds its kernels with them)" >&2
    exit 2
  fi
  apt-get update
  # shellcheck disable=SC2086 # one argument per package
  apt-get install -y --no-install-recommends $missing
  rm -rf /var/lib/apt/lists/*
fi
gcc --version >/dev/null
if [ ! -f "$include/Python.h" ]; then
  echo "no $include/Python.h after installing python3-dev: Triton's launchers cannot build" >&2
  exit 2
fi
echo "Triton toolchain: gcc and $include/Python.h"
