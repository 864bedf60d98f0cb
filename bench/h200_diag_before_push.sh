#!/usr/bin/env bash
# The KV push between two plain processes on the H200 after what a prefill replica does before
# kv_ready (issue 25): nothing, GPU work + a stream sync, cache-cold host work, and GPU work with
# the write prepared before it. On a machine with the gpu_stack bundle; OUT: the device call's folder.
#   OUT=$OUT bash bench/h200_diag_before_push.sh
set -u
D=/tmp/fpdiag2; pip install -q --no-deps --no-index --no-build-isolation --target $D . ./sdk >/dev/null 2>&1 || exit 1
export PYTHONPATH=$D${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
R=$(pwd); cd /tmp
for v in "plain|" "gpu work + sync|--before-push gpu --before-push-ms 30" "cpu work|--before-push cpu --before-push-ms 30" "gpu work + sync, prepared ahead|--before-push gpu --before-push-ms 30 --prepare-ahead"; do
  IFS='|' read -r label extra <<<"$v"
  echo "== $label"
  timeout 60 python -m flashpd.bench.transfer_phases --device cuda --sizes 32768 131072 --reps 10 $extra --label "$label" --out $OUT/transfer_before_push.md --append 2>&1 | tail -3
done
