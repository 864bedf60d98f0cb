#!/usr/bin/env bash
# Installs everything flashpd needs on a fresh Debian machine with Python 3.10+ (idempotent).
# torch (the CPU wheel on disk) and nixl go in ONE pip command: alone, nixl would pull a
# multi-GB CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1 \
    || ! command -v unshare >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq redis-server iproute2 util-linux >/dev/null
fi
python -m pip install -q --disable-pip-version-check \
  torch==2.13.0 -e ".[serve,bench,dev]" -e ./sdk
