#!/usr/bin/env bash
# The flashpd product on one GPU machine, in one command (README: "On a GPU"):
#   bash scripts/gpu_stack.sh                      Redis + Ray + infra/serve.h200.yaml; prints
#                                                  "ready" after load and warm-up; Ctrl-C stops
#   bash scripts/gpu_stack.sh --check              validate the config only (also on a CPU)
#   bash scripts/gpu_stack.sh --config FILE ...    another Serve config (services/gpu_stack.py)
#   bash scripts/gpu_stack.sh bench OUT [ARGS]     the same stack measured through real clients
#                                                  (bench/h200_stack.py: results in OUT)
#   bash scripts/gpu_stack.sh agentx sweep|report ARGS   the AgentX sweep of one config (issue
#                                                  28: bench/agentx_gpu.py; absolute paths)
# On a machine without Ray/Redis/NIXL it sources .gpu_stack/install.sh (the bundle built by
# ../shared/tools/gpu_stack/build.sh); without flashpd importable it installs this checkout
# (and the SDK) into $FLASHPD_SITE (default /tmp/flashpd-site) with no index; wheels in .whl/
# (xgrammar, apache-tvm-ffi, the openai client) go in when those are missing.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! (cd /tmp && python3 -c "import ray, redis, nixl") 2>/dev/null && [ -f "$REPO/.gpu_stack/install.sh" ]; then
    . "$REPO/.gpu_stack/install.sh" "$REPO/.gpu_stack"  # (its $1 is the folder: not our arguments)
fi
if ! (cd /tmp && python3 -c "import flashpd.services.gpu_stack, flashpd_sdk") 2>/dev/null; then
    SITE=${FLASHPD_SITE:-/tmp/flashpd-site}
    pip install -q --no-deps --no-index --no-build-isolation --target "$SITE" "$REPO" "$REPO/sdk"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! (cd /tmp && python3 -c "import xgrammar, openai") 2>/dev/null && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    # wheels carried to a machine with no index (xgrammar + apache-tvm-ffi: the decode
    # replica's guided decoding; openai and its dependencies: the bench's client)
    WHEELS=${FLASHPD_WHEELS_SITE:-/tmp/flashpd-wheels}
    pip install -q --no-index --no-deps --no-compile --target "$WHEELS" "$REPO"/.whl/*.whl
    export PYTHONPATH="$WHEELS${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
cd /tmp  # the checkout's folders must not shadow the installed package
if [ "${1:-}" = bench ]; then
    shift
    OUT=${1:?usage: gpu_stack.sh bench OUT [ARGS]}
    shift
    exec python3 -m flashpd.bench.h200_stack --out "$OUT" --config "$REPO/infra/serve.h200.yaml" "$@"
fi
if [ "${1:-}" = agentx ]; then
    shift
    exec python3 -m flashpd.bench.agentx_gpu "$@"
fi
ARGS=("$@")
case " $* " in *" --config "*) ;; *) ARGS=(--config "$REPO/infra/serve.h200.yaml" "$@") ;; esac
exec python3 -m flashpd.services.gpu_stack "${ARGS[@]}"
