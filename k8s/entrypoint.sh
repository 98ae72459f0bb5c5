#!/bin/sh
# baton-entrypoint ROLE [FLAGS...]: the container image's entrypoint. ROLE picks the
# service; FLAGS go to it unchanged (every flag also has a BATON_<ROLE>_* env twin).
#   gateway  python -m gateway
#   prefill  python -m prefill_service
#   decode   python -m decode_service
#   single   python -m decode_service --single-process (prefill and decode in one engine)
# `baton-entrypoint ROLE --check-config ...` prints the resolved configuration and exits.
set -eu
role="${1:-}"
if [ "$#" -gt 0 ]; then shift; fi
case "$role" in
  gateway) exec python -m gateway "$@" ;;
  prefill) exec python -m prefill_service "$@" ;;
  decode) exec python -m decode_service "$@" ;;
  single) exec python -m decode_service --single-process "$@" ;;
  *)
    echo "usage: baton-entrypoint gateway|prefill|decode|single [FLAGS...] (got '$role')" >&2
    exit 2
    ;;
esac
