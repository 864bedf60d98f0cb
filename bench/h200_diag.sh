#!/usr/bin/env bash
# One device call of diagnostics (issues 25 and 26), on a machine with the gpu_stack bundle:
#   bash bench/h200_diag.sh OUT [SECONDS]
# 1. the KV push between two plain processes on the H200, in variants that each add one thing a
#    Serve replica has (transfer_phases.md): a Ray actor, 55 GB + 200 captured graphs of
#    ballast, two GIL-busy Python threads, UCX's memory-type cache off; the push's own CPU time
#    and context switches are columns (send_cpu_ms / send_vcsw / send_ivcsw)
# 2. the GPU-path tests (gpu_tests.txt)
# 3. where a speculative verify step's device time goes (verify_profile.md, forced AL 3.51)
# Each step gets what is left of the box; outputs are flat files in OUT.
set -u
OUT=${1:?OUT}; BOX=${2:-560}
START=$(date +%s)
left() { echo $(( BOX - ($(date +%s) - START) )); }
REPO=$(pwd)
exec > >(tee -a "$OUT/diag_log.txt") 2>&1
D=/tmp/fpdiag$RANDOM
pip install -q --no-deps --no-index --no-build-isolation --target "$D" . ./sdk || exit 1
export PYTHONPATH=$D${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
cd /tmp
push() {  # $1 label, rest: extra args (env via `env` prefix in the label's caller)
    local label=$1; shift
    echo "== push: $label ($(left) s left)"
    timeout 90 "$@" --device cuda --sizes 8192 32768 131072 --reps 15 --label "$label" \
        --out "$OUT/transfer_phases.md" --append 2>&1 | tail -4
}
push plain python -m flashpd.bench.transfer_phases
push "ray actor" python -m flashpd.bench.transfer_phases --in-ray-actor
push "ballast 55 GB + 200 graphs" python -m flashpd.bench.transfer_phases --ballast-gb 55 --ballast-graphs 200
push "2 busy threads" python -m flashpd.bench.transfer_phases --busy-threads 2
push "UCX_MEMTYPE_CACHE=n" env UCX_MEMTYPE_CACHE=n python -m flashpd.bench.transfer_phases
echo "== GPU-path tests ($(left) s left)"
timeout $(( $(left) - 170 )) python -m pytest -q -m "not soak" --tb=short --rootdir "$REPO" \
    "$REPO/tests/engine/gpu" > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|Error|error" "$OUT/gpu_tests.txt" | tail -12
echo "== verify profile ($(left) s left)"
FLASHPD_BENCH_FORCED_ACCEPTANCE=1 timeout $(( $(left) - 10 )) python -m flashpd.bench.gpu_profile \
    --spec 3.51 --batch 1 8 --host --out "$OUT" 2>&1 | tail -30
echo "== done ($(left) s left)"
