#!/usr/bin/env bash
# The main job: serve the small model (trained on ShareGPT, shipped in model/presets/small_checkpoint)
# locally (Ray Serve + Redis + NIXL) and chat through the SDK; `--preset tiny` for random weights.
# Runs inside a loopback-only network namespace when possible, so nothing leaves this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
export UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN RAY_USAGE_STATS_ENABLED=0
if unshare -n true 2>/dev/null; then
  exec unshare -n sh -c 'ip link set lo up && flashpd demo "$@"' sh "$@"
fi
exec flashpd demo "$@"
