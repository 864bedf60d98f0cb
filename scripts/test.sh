#!/usr/bin/env bash
# The test command: the whole default suite inside a loopback-only network namespace.
set -euo pipefail
cd "$(dirname "$0")/.."
export UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN RAY_USAGE_STATS_ENABLED=0 TRITON_INTERPRET=1
# unbuffered: a native library (UCX/NIXL teardown) ends the process before stdio is flushed,
# which would swallow pytest's closing summary line
export PYTHONUNBUFFERED=1
exec unshare -n sh -c 'ip link set lo up && python -m pytest -q "$@"' sh "$@"
