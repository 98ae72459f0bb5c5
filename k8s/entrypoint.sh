#!/bin/sh
# baton-entrypoint ROLE [FLAGS...]: the container image's entrypoint. ROLE picks the
# service; FLAGS go to it unchanged (every flag also has a BATON_<ROLE>_* env twin).
#   gateway  python -m gateway
#   prefill  python -m prefill_service
#   decode   python -m decode_service
#   single   python -m decode_service --single-process (prefill and decode in one engine)
#   fetch-model  python -m engine.model_fetch (the init step of model.source hf: download
#            a Hugging Face model once into a volume)
#   pair     PREFILL_FLAGS... -- DECODE_FLAGS...: python -m prefill_service and python -m
#            decode_service side by side in this one container, so they share its GPU
#            (co-located cuda_ipc: CUDA IPC needs both processes on one device, and the
#            device plugin gives each container that asks for a GPU a different one).
#            SIGTERM/SIGINT go to both (each drains; the container exits 0 when both
#            did). When either exits on its own the other is sent SIGTERM and the
#            container exits with the first one's status (1 if that was 0: a worker that
#            stops unasked is a failure for the kubelet to restart). With --check-config
#            the two resolved configurations are printed one after the other.
# `baton-entrypoint ROLE --check-config ...` prints the resolved configuration and exits.
set -eu
role="${1:-}"
if [ "$#" -gt 0 ]; then shift; fi

# pair: both processes of one container; see the header.
run_pair() {
  n=0
  check=0
  for a in "$@"; do
    if [ "$a" = -- ]; then break; fi
    n=$((n + 1))
  done
  if [ "$n" -eq "$#" ]; then
    echo "usage: baton-entrypoint pair PREFILL_FLAGS... -- DECODE_FLAGS..." >&2
    exit 2
  fi
  for a in "$@"; do
    if [ "$a" = --check-config ]; then check=1; fi
  done
  prefill_worker() {
    # The first n arguments are the prefill worker's flags.
    i=0
    for a in "$@"; do
      shift
      if [ "$i" -lt "$n" ]; then set -- "$@" "$a"; fi
      i=$((i + 1))
    done
    exec python -m prefill_service "$@"
  }
  if [ "$check" = 1 ]; then
    # One resolved configuration after the other, not interleaved.
    (prefill_worker "$@")
    shift "$((n + 1))"
    exec python -m decode_service "$@"
  fi
  # The trap is set before either worker starts: a SIGTERM that lands while they start
  # must not kill this shell with its workers left running (the pod would hang until
  # SIGKILL). A worker started after the signal is stopped at once.
  prefill=""
  decode=""
  stopping=0
  trap 'stopping=1; for p in $prefill $decode; do kill -TERM "$p" 2>/dev/null || true; done' TERM INT
  (prefill_worker "$@") &
  prefill=$!
  shift "$((n + 1))"
  python -m decode_service "$@" &
  decode=$!
  if [ "$stopping" = 1 ]; then kill -TERM "$prefill" "$decode" 2>/dev/null || true; fi
  # Poll rather than `wait -n` (not POSIX); a short sleep in the background keeps the
  # traps prompt. Once stopping, the signal is repeated each round: a worker forked while
  # it came can lose it (the forked shell resets its traps before it execs), and the
  # services take a repeated SIGTERM as the same request (rpc/server.py).
  while kill -0 "$prefill" 2>/dev/null && kill -0 "$decode" 2>/dev/null; do
    if [ "$stopping" = 1 ]; then kill -TERM "$prefill" "$decode" 2>/dev/null || true; fi
    sleep 1 &
    wait "$!" || true
  done
  if kill -0 "$prefill" 2>/dev/null; then
    first=decode
    other=$prefill
    status=0
    wait "$decode" || status=$?
  else
    first=prefill
    other=$decode
    status=0
    wait "$prefill" || status=$?
  fi
  if [ "$stopping" = 0 ]; then
    echo "baton-entrypoint pair: the $first worker exited ($status); stopping the other" >&2
    kill -TERM "$other" 2>/dev/null || true
    if [ "$status" -eq 0 ]; then status=1; fi
  fi
  while [ "$stopping" = 1 ] && kill -0 "$other" 2>/dev/null; do
    kill -TERM "$other" 2>/dev/null || true
    sleep 1 &
    wait "$!" || true
  done
  other_status=0
  wait "$other" || other_status=$?
  if [ "$status" -eq 0 ]; then status=$other_status; fi
  exit "$status"
}

case "$role" in
  gateway) exec python -m gateway "$@" ;;
  prefill) exec python -m prefill_service "$@" ;;
  decode) exec python -m decode_service "$@" ;;
  single) exec python -m decode_service --single-process "$@" ;;
  pair) run_pair "$@" ;;
  fetch-model) exec python -m engine.model_fetch "$@" ;;
  *)
    echo "usage: baton-entrypoint gateway|prefill|decode|single|pair|fetch-model [FLAGS...] (got '$role')" >&2
    exit 2
    ;;
esac
