#!/usr/bin/env bash
# The test command: `ruff format --check` and `ruff check`, then every CPU test (slow ones included; `soak` load runs: add `-m soak`) inside a
# loopback-only network namespace.
# The quick developer loop is plain `pytest` (pyproject's addopts skip `slow` and `gpu`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
export UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN RAY_USAGE_STATS_ENABLED=0 TRITON_INTERPRET=1
export PYTHONUNBUFFERED=1
# the formatter and the linter first (ruff is pinned in the dev extras: its output is versioned)
python -m ruff format --check --quiet . || { echo "ruff format --check: run 'ruff format .'"; exit 1; }
python -m ruff check --quiet .
report=$(mktemp -t flashpd-junit-XXXXXX.xml)
rm -f "$report"
set +e
# A whole-run cap (not a tolerance): a hung teardown must not hold CI; the summary below still
# comes from the report pytest wrote.
unshare -n sh -c 'ip link set lo up && timeout --kill-after=30 3600 python -m pytest -q -m "not gpu and not soak" --junitxml="$0" "$@"' "$report" "$@"
rc=$?
set -e
# Ray's driver teardown can end pytest before its closing line: print it from the report.
python scripts/junit_summary.py "$report" || rc=1
rm -f "$report"
exit $rc
