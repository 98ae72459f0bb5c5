#!/usr/bin/env bash
# Prepares .gpu_carry/ (in .gitignore) for benchmarks/gpu_check.sh on a GPU machine that
# reaches no package registry. Run it where pip and the bundled model work (a
# developer's machine, after .ci/setup.sh):
#
#   bash benchmarks/gpu_pack.sh
#
# It writes
#   .gpu_carry/wheels/  the packages gpu_check.sh may need to add to a stock
#                       PyTorch + Triton + transformers image (CPython 3.12, x86-64):
#                       grpcio-health-checking, grpcio-reflection, gguf, xxhash, the
#                       grpcio / protobuf versions baton's generated protos need, and
#                       the gateway's starlette, uvicorn and OpenTelemetry API/SDK,
#                       and NIXL (nixl-cu12) for the nixl transport's GPU test;
#   .gpu_carry/part0/,  the bundled SmolLM2 GGUF (98 MB) cut in two, each part with the
#   .gpu_carry/part1/   checksums of all parts and of the whole file: one run of the
#                       device tool carries at most 64 MiB, so the model travels in two.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
CARRY=.gpu_carry
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PART_BYTES=$((47 * 1024 * 1024))  # two even parts, each run under 64 MiB with the wheels

rm -rf "$CARRY"
mkdir -p "$CARRY/wheels" "$CARRY/part0" "$CARRY/part1"

# Same versions as this environment, for the GPU machine's Python.
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=()
for dist in grpcio-health-checking grpcio-reflection gguf xxhash protobuf grpcio starlette \
    uvicorn opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions nixl-cu12; do
  wheels+=("$dist==$(version "$dist")")
done
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$CARRY/wheels" "${wheels[@]}"

gguf=$("$PY" -c "
from engine.model_files import find_bundled_gguf
print(find_bundled_gguf('smollm2-135m')[1])")
split --bytes="$PART_BYTES" --numeric-suffixes=0 --suffix-length=1 "$gguf" "$CARRY/$GGUF_NAME.part"
mv "$CARRY/$GGUF_NAME.part0" "$CARRY/part0/"
mv "$CARRY/$GGUF_NAME.part1" "$CARRY/part1/"
if ls "$CARRY/$GGUF_NAME".part* >/dev/null 2>&1; then
  echo "gpu_pack: the model needs more than two parts; raise PART_BYTES" >&2
  exit 1
fi
{
  sha256sum "$gguf" | awk -v n="$GGUF_NAME" '{print $1 "  " n}'
  (cd "$CARRY/part0" && sha256sum "$GGUF_NAME.part0")
  (cd "$CARRY/part1" && sha256sum "$GGUF_NAME.part1")
} >"$CARRY/SHA256SUMS"
cp "$CARRY/SHA256SUMS" "$CARRY/part0/"
mv "$CARRY/SHA256SUMS" "$CARRY/part1/"
du -sh "$CARRY"/* | sed 's/^/gpu_pack: /'
echo "gpu_pack: carry .gpu_carry/wheels and .gpu_carry/part0 in one device run," \
     "then .gpu_carry/wheels and .gpu_carry/part1 in the next (README \"GPU\")."
