#!/usr/bin/env bash
# Installs everything flashpd's CLI, demo and tests import, from the repo's own files, on a fresh
# Debian machine with Python 3.10+ (idempotent).
#
# Python packages go into a virtual environment: the active one ($VIRTUAL_ENV), else ./.venv,
# created here without system site-packages so nothing installed by hand can hide a missing step.
# scripts/demo.sh and scripts/test.sh use the same one.
#
# torch (the CPU wheel on disk) and nixl go in ONE pip command: alone, nixl would pull a
# multi-GB CUDA torch. triton (pinned to the GPU machine's 3.6) runs the kernels' tests on the
# CPU through its interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1 \
    || ! command -v unshare >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq redis-server iproute2 util-linux >/dev/null
fi

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q --disable-pip-version-check \
  torch==2.13.0 -e ".[serve,bench,dev,gpu]" -e ./sdk
python -c "import flashpd.cli, torch, triton, ray, nixl, redis, grpc, openai, xgrammar, jsonschema" \
  || { echo "setup: an import failed after install" >&2; exit 1; }
echo "setup: installed into ${VIRTUAL_ENV}"
