#!/usr/bin/env bash
# Several AgentX sweeps back to back in ONE device call (issue 28), on a warm machine after the
# bundle's parts: each brings the stack up from its config, runs its points and takes it down; a
# sweep that cannot start with >= 110 s left is skipped. The sweeps write to /tmp/agentx_h200
# (kept across calls while the machine stays up) and the whole folder is tarred into
# $OUT/agentx.tgz at the end: the device copies back only shallow files under $OUT, so the
# point folders (NAME/cC/records.jsonl) must travel in the tarball.
#   bash scripts/agentx_calls.sh BOX_S "CONFIG|NAME|CONCURRENCY|SWITCH" ...
#   e.g. bash scripts/agentx_calls.sh 585 "serve.h200.yaml|off-indexer|1,4|indexer" \
#            "serve.h200.baseline.yaml|baseline|1,2,4|"
# CONFIG is a file in infra/; SWITCH (optional) one of agentx_gpu.SWITCHES. Logs: $OUT/log_NAME.txt,
# the replicas' error excerpts: NAME/server_errors.log inside the tarball.
set -u
BOX=${1:?usage: agentx_calls.sh BOX_S "CONFIG|NAME|CONCURRENCY|SWITCH" ...}
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:?set OUT: the output folder of the device call}
END=$(($(date +%s) + BOX))
mkdir -p /tmp/agentx_h200
for spec in "$@"; do
    IFS='|' read -r cfg name conc sw <<<"$spec"
    left=$((END - $(date +%s)))
    if [ "$left" -lt 110 ]; then
        echo "=== $name skipped: $left s left"
        continue
    fi
    args=(--config "$REPO/infra/$cfg" --name "$name" --out /tmp/agentx_h200 --concurrency "$conc" --end-unix "$END" --teardown-s 12)
    [ -n "${sw:-}" ] && args+=(--switch-off "$sw")
    echo "=== $name $(date +%T), $left s left"
    bash "$REPO/scripts/gpu_stack.sh" agentx sweep "${args[@]}" >"$OUT/log_$name.txt" 2>&1
    echo "=== $name exit $? $(date +%T)"
    grep -E "ready in|agentx .* c=|records in|server error" "$OUT/log_$name.txt" | tail -12
done
tar czf "$OUT/agentx.tgz" -C /tmp agentx_h200
